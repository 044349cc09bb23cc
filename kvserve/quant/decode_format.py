"""The base of the block-quantized layers: decode rows through the blocks, prompt rows through
an optional prefill copy (bf16 or W8A8) or through the same blocks under int8 activations."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.quant.bf16 import Bf16Linear
from kvserve.quant.common import _block_quantized_forward, _buffer_bytes
from kvserve.quant.w8a8 import W8A8Linear
from kvserve.token_roles import current_token_roles


class DecodeFormatLinear(nn.Module):
    """A linear layer on block-quantized weights (GGUF's formats, read by kvserve's kernels in
    kvserve/csrc/quant_linear.cpp) that may also hold a copy of its weights for prompt tokens.

    The block kernels suit decode, whose few rows per step are bound by the bytes read, not
    prefill, where hundreds of rows make the step compute-bound and unpacking small integers
    costs more than the bytes it saves (issue #17: SmolLM2's 256-token TTFT was 481 ms through
    the 4-bit row kernel, 204 ms with bf16 weights). ``add_prefill_copy`` gives the layer a
    ``Bf16Linear`` holding ``bf16(w)`` (or, opt-in, a ``W8A8Linear`` of the blocks' own codes,
    faster with AVX512-VNNI, under rounded activations),
    and the rows of a step's prompt tokens go through it,
    the others through the blocks (kvserve/token_roles.py: by the token's role, never by the
    batch, so results stay deterministic). Where the blocks' kernel is the faster one at
    prefill too (``prefill_copy_pays``: the AVX512 4-bit tiles on Intel's cores), the layer
    keeps no copy under ``int4_prefill="auto"``.

    Subclasses define ``dequantized()`` (the fp32 weights) and ``forward_blocks(x)``.
    """

    bias: Optional[torch.Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.prefill: Optional[nn.Module] = None  # Bf16Linear or W8A8Linear
        # Prompt rows through this layer's own tiles with their activations rounded to int8
        # (use_int8_prompts): no copy, half the multiplies of the decode rows' split 16-bit ones.
        self.int8_prompts = False

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prefill_copy_pays(self) -> bool:
        """Whether prompt rows run faster through a bf16 copy than through this layer's blocks
        here (``int4_prefill="auto"``). Yes but where a subclass measured otherwise: on the AVX2
        route the bf16 kernel beats the nibble tiles at 256 rows (1.08x on SmolLM2's Q4_1 layers,
        1.3x on Gemma 3's Q4_K and Q5_0; benchmarks/results/zen3-avx2-nibble-tiles), and the Q8 kernel
        (Q8_0, Q6_K: int8 widened to fp32 FMAs) runs at half the bf16 kernel's rate everywhere."""
        return True

    def affine_codes(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The weights as ``w = a * u + b`` per group of 32 inputs, exactly: (codes u ``[N, K]``
        in 0..255, a, b fp32 ``[N, ceil(K / 32)]``), what a W8A8Linear copy holds; None where the
        format's groups are not 32 inputs of one a and b (Q6_K's 16)."""
        return None

    def make_prefill_copy(self, copy_format: str = "bf16") -> nn.Module:
        """The layer's prefill weights in ``copy_format``: "bf16" (Bf16Linear) or "int8" (a
        W8A8Linear of the format's own codes; a Bf16Linear where the format has none)."""
        if copy_format not in ("bf16", "int8"):
            raise ValueError(f"unknown prefill copy format {copy_format!r}")
        codes = self.affine_codes() if copy_format == "int8" else None
        return Bf16Linear(self.dequantized(), self.bias) if codes is None else W8A8Linear(*codes, self.bias)

    def add_prefill_copy(self, copy_format: str = "bf16") -> int:
        """Give the layer its prefill weights (``make_prefill_copy``); their bytes."""
        self.prefill = self.make_prefill_copy(copy_format)
        return _buffer_bytes(self.prefill)

    def reads_int8_prompts(self) -> bool:
        """Whether the int8 prompt kernel (csrc/quant_linear.cpp's PromptActivations, AVX512-VNNI)
        reads this layer's weights: the tiled layouts (``packed``) of Q4_K, Q4_1, Q4_0, Q5_0 and Q6_K."""
        return getattr(self, "packed", None) is not None and ops.int8_prompt_kernels()

    def use_int8_prompts(self) -> bool:
        """Compute prompt rows through the blocks under int8 activations where the kernel reads
        them (the layer keeps a prefill copy's rows if it has one); whether it now does."""
        self.int8_prompts = self.prefill is None and self.reads_int8_prompts()
        return self.int8_prompts

    def forward_int8_prompts(self, x: torch.Tensor) -> torch.Tensor:
        """Every row through the blocks under int8 activations (rounded per row and group of 32)."""
        return _block_quantized_forward(
            self, x, lambda ext, rows: ext.tiled_nibble_int8_linear(rows, self.packed, self.out_features, self.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, features]: the step's prompt rows through the prefill weights (or the int8
        prompt path) when the layer has them and the step's roles are installed, every other row
        through the blocks."""
        prompt_fn = self.prefill if self.prefill is not None else (
            self.forward_int8_prompts if self.int8_prompts else None)
        roles = None if prompt_fn is None else current_token_roles()
        if roles is None:
            return self.forward_blocks(x)
        return roles.apply(x, prompt_fn, self.forward_blocks)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's sums in plain torch: the activations rounded as the kernel rounds them
        here (``ops.nibble_kernel_activations``: 16-bit groups on AVX512/AVX2, else bf16) times the
        weights, in fp32 (another summation order: equal to rounding, not bit for bit). Slow:
        for machines without the extension."""
        y = ops.nibble_kernel_activations(x.float()) @ self._reference_weight().T
        return y if self.bias is None else y + self.bias

    def _reference_weight(self) -> torch.Tensor:
        if getattr(self, "_reference", None) is None:
            self._reference = self.dequantized()
        return self._reference
