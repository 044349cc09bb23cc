"""8-bit weights: GGUF Q8_0 and Q6_K as stored (and the int4 mode's Q8_0 LM head)."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from gguf import GGMLQuantizationType

from kvserve import block_formats, ops
from kvserve.config import ConfigError
from kvserve.quant.common import (INT4_GROUP_SIZE, _block_quantized_forward, _block_quantized_forward_into, _fp32_bias,
                                  _packed_by_kernel, read_only_parts)
from kvserve.quant.decode_format import DecodeFormatLinear


class Q8Linear(DecodeFormatLinear):
    """8-bit weights ``w = d * q`` with fp32 activations (fp32 products): GGUF Q8_0 (groups of
    32, ``q`` in -127..127, ``d`` fp16; the int4 mode's LM head, as llama.cpp stores SmolLM2's)
    or Q6_K (groups of 16, ``q - 32`` in -32..31, ``d * sc`` in fp32: exact). ``qs`` int8
    [N, K]; ``d`` fp16 bits (int16) [N, K / 32] or fp32 [N, K / 16]."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.register_buffer("qs", qs.contiguous())
        self.register_buffer("d", d.contiguous())
        self.register_buffer("bias", _fp32_bias(bias))
        self.out_features, self.in_features = qs.shape

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Q8Linear":
        """Q8_0 quantization (symmetric per group of 32)."""
        n, k = weight.shape
        if k % INT4_GROUP_SIZE:
            raise ConfigError(f"Q8_0 needs in_features divisible by {INT4_GROUP_SIZE}, got {k}")
        blocks = _packed_by_kernel("q8_0_quantize", weight)
        return cls(*(blocks if blocks is not None else cls.quantize_reference(weight)))

    @staticmethod
    def quantize_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qs, d) of from_float in plain torch (the extension's q8_0_quantize)."""
        n, k = weight.shape
        w = weight.detach().float().view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        d = (w.abs().amax(dim=-1) / 127.0).half()
        # Requantizing a dequantized Q8_0 tensor this way gives back its blocks exactly.
        q = torch.round(w / d.float().clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
        return q.view(n, k), d.view(torch.int16)

    @classmethod
    def from_gguf_raw(cls, data: np.ndarray, type_name: str, shape: tuple[int, ...],
                      bias: Optional[torch.Tensor]) -> Optional["Q8Linear"]:
        """The layer straight from a Q8_0 or Q6_K tensor's bytes, natively (block_repack.cpp:
        ``from_byte_blocks``' values without its temporaries); None without the extension."""
        ext = ops.load_extension()
        if ext is None or type_name not in ("Q8_0", "Q6_K"):
            return None
        qs, d = ext.gguf_byte_blocks(read_only_parts(data), int(GGMLQuantizationType[type_name]), shape[-1])
        return cls(qs, d, bias)

    @classmethod
    def from_byte_blocks(cls, blocks: block_formats.ByteBlocks, bias: Optional[torch.Tensor]) -> "Q8Linear":
        return cls(torch.from_numpy(np.ascontiguousarray(blocks.q)), torch.from_numpy(np.ascontiguousarray(blocks.d)),
                   bias)

    def dequantized(self) -> torch.Tensor:
        return torch.from_numpy(block_formats.byte_values(block_formats.ByteBlocks(self.qs.numpy(), self.d.numpy())))

    def affine_codes(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Q8_0: codes ``q + 128``, a = d, b = -128 d. Q6_K (groups of 16): None."""
        blocks = block_formats.ByteBlocks(self.qs.numpy(), self.d.numpy())
        if blocks.group != INT4_GROUP_SIZE:
            return None
        d = torch.from_numpy(blocks.scales)
        return self.qs.to(torch.int32) + 128, d, -128.0 * d

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return _block_quantized_forward(self, x, lambda ext, rows: ext.q8_linear(rows, self.qs, self.d, self.bias))

    def forward_into(self, x: torch.Tensor, buffer: Callable[[int], torch.Tensor]) -> Optional[torch.Tensor]:
        """``self(x)`` into ``buffer(rows)`` (see Bf16Linear.forward_into); not for a layer with
        prefill weights, whose rows may take either format."""
        return _block_quantized_forward_into(
            self, x, buffer, self.prefill is None,
            lambda ext, rows, out: ext.q8_linear_out(out, rows, self.qs, self.d, self.bias))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (d * q)^T`` in plain torch (fp32 activations, as the kernel)."""
        y = x.float() @ self._reference_weight().T
        return y if self.bias is None else y + self.bias
