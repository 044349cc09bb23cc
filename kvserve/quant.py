"""Weight formats for the linear layers: bf16, INT8 and INT4 weights under fp32 activations.

Decode at small batch reads every weight once per token: it is bound by memory, not compute.
Storing the weights in 16, 8 or 4 bits cuts the bytes read per token 2-8x against fp32, and
bf16 matmuls run at about twice the fp32 rate on CPUs with AVX512-BF16/AMX. The activations
(the residual stream, norms, rope, attention) stay in the model's dtype, fp32 by default:
rounding the residual stream to bf16 at every layer is what costs a bf16 model its accuracy
(top-1 agreement with fp32 drops from 99 % to 95 % on SmolLM2), not the bf16 weights.

int8 uses torch's ``_weight_int8pack_mm`` (per-output-channel scales, bf16 activations).
int4 mode ("the file's own blocks") reads a GGUF's block-quantized matrices as stored, with
kvserve's kernels (kvserve/csrc/quant_linear.cpp, kvserve/block_formats.py): SmolLM2's file is
Q4_1, Gemma 3's a mix of Q5_0, Q8_0, Q4_K and Q6_K; every value is used exactly as llama.cpp
uses it. Float checkpoints are quantized to Q4_1-style groups. The LM head is Q8_0.
The block-quantized weights live in one huge-page buffer in the order a step reads them.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch import nn

from kvserve import block_formats, ops
from kvserve.config import INT4_PREFILL_MODES, ConfigError
from kvserve.row_table import RowSource, gathered_rows_dot, keep_embedding_as_blocks, table_args
from kvserve.token_roles import current_token_roles

logger = logging.getLogger(__name__)

WEIGHT_FORMATS = ("bf16", "int8", "int4")
INT4_GROUP_SIZE = 32
# The low-precision LM head's top candidates are rescored with the fp32 weights so that
# greedy picks and top logprobs carry fp32 precision (bf16 logits have ~3 significant digits).
LM_HEAD_RESCORE_TOP_K = 16
# A step that needs only each row's argmax (kvserve.sampler.argmax_suffices) ranks the
# vocabulary with the head's 4-bit screen and rescores this many candidates in fp32. On the
# real models' texts the fp32 argmax ranked at most 12th in the screen (1,512 positions,
# benchmarks/results/zen4-screen-groups-64): 64 leaves a margin, and rescoring 64 rows costs
# microseconds.
SCREEN_TOP_K = 64
_KERNEL_DTYPE = torch.bfloat16


def batch_invariant_linears() -> bool:
    """kvserve's batch-invariant kernels for bf16 and fp32 weights (the default), or, with
    ``KVSERVE_BATCH_INVARIANT=0``, the BLAS paths used before (oneDNN, MKL): an explicit
    opt-out of determinism for machines where those are faster (AMX prefill)."""
    return os.environ.get("KVSERVE_BATCH_INVARIANT", "1") != "0"


BF16_PANEL = 32  # output columns per packed panel of kvserve's bf16 kernel (csrc/dense_linear.cpp)


def _packed_by_kernel(kernel: str, weight: torch.Tensor) -> Optional[Any]:
    """The extension's load-time packer ``kernel`` (pack_bf16_weight, q8_0_quantize,
    q4_screen_pack) applied to a CPU ``weight``: one pass, the values of its plain-torch
    reference; None where the extension is off or the weight is elsewhere (the reference then)."""
    ext = ops.cpu_extension()
    if ext is None or weight.device.type != "cpu":
        return None
    return getattr(ext, kernel)(weight.detach().float().contiguous())


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the bf16 bits (int16) of ``[Np / 32, Kp / 2, 32, 2]``: panels of 32 output
    columns, then pairs of K (N rounded up to 32, K to 2, with zeros). One 512-bit load of
    a panel is 16 columns x 2 k, what one vdpbf16ps multiplies with a broadcast k pair."""
    packed = _packed_by_kernel("pack_bf16_weight", weight)
    return packed if packed is not None else pack_bf16_weight_reference(weight)


def pack_bf16_weight_reference(weight: torch.Tensor) -> torch.Tensor:
    """pack_bf16_weight in plain torch."""
    n, k = weight.shape
    np_, kp = -(-n // BF16_PANEL) * BF16_PANEL, k + k % 2
    padded = torch.zeros(np_, kp, dtype=torch.bfloat16, device=weight.device)
    padded[:n, :k] = weight.detach().to(torch.bfloat16)
    packed = padded.view(np_ // BF16_PANEL, BF16_PANEL, kp // 2, 2).permute(0, 2, 1, 3)
    return packed.contiguous().view(torch.int16)


def unpack_bf16_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_bf16_weight's inverse: the bf16 ``[n, k]`` weight."""
    panels, pairs = packed.shape[0], packed.shape[1]
    rows = packed.view(torch.bfloat16).permute(0, 2, 1, 3).reshape(panels * BF16_PANEL, pairs * 2)
    return rows[:n, :k]


class Bf16Linear(nn.Module):
    """bf16 weights under any activation dtype: the input is rounded to bf16, the products
    summed in fp32.

    On the CPU with kvserve's extension the weight is packed for kvserve's own kernel
    (csrc/dense_linear.cpp), which reduces every output over K in one fixed order whatever
    the number of rows: a row's result does not depend on the batch around it. oneDNN, used
    before, changes its reduction with the row count (a request's logprobs then moved with
    the batch); measured at par with it or faster on SmolLM2's and Gemma 3's shapes, 1 to
    512 rows. Without the extension (no compiler) the weight is pre-packed for oneDNN, as
    inductor does for frozen CPU models; elsewhere (CUDA) a plain ``F.linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        cpu = weight.device.type == "cpu"
        self.packed = cpu and batch_invariant_linears() and ops.load_extension() is not None
        # oneDNN's bf16 path needs AVX512BW/VL/DQ or AVX-NE-CONVERT (its reorder raises on a
        # Zen 3); elsewhere the plain F.linear.
        self.prepacked = (cpu and not self.packed and torch.backends.mkldnn.is_available()
                          and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if self.packed:
            w = pack_bf16_weight(weight)
            b = None if bias is None else bias.detach().float().contiguous()
        else:
            w = weight.detach().to(_KERNEL_DTYPE)
            if self.prepacked:
                w = torch.ops.mkldnn._reorder_linear_weight(w, None)
            b = None if bias is None else bias.detach().to(_KERNEL_DTYPE)
        self.register_buffer("weight", w)
        self.register_buffer("bias", b)
        self._unpacked: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            n = self.out_features
            return _block_quantized_forward(self, x, lambda ext, rows: ext.bf16_linear(rows, self.weight, n, self.bias))
        x16 = x.to(_KERNEL_DTYPE)
        if self.prepacked:
            # The models pass [tokens, features]: no reshape ops on the per-token path.
            rows = x16 if x16.dim() == 2 else x16.reshape(-1, self.in_features)
            y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
            if x.dim() != 2:
                y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = nn.functional.linear(x16, self.weight, self.bias)
        return y.to(x.dtype)

    def forward_into(self, x: torch.Tensor, buffer: Callable[[int], torch.Tensor]) -> Optional[torch.Tensor]:
        """``self(x)`` written by kvserve's kernel into ``buffer(rows)`` (float32 ``[rows,
        out_features]``, asked for only then), which it returns; None where this layer does not
        run on that kernel."""
        return _block_quantized_forward_into(
            self, x, buffer, self.packed, lambda ext, rows, out: ext.bf16_linear_out(out, rows, self.weight, self.bias))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The packed kernel's sums in plain torch: bf16-rounded activations times the bf16
        weights, in fp32 (another summation order: equal to rounding, not bit for bit)."""
        if self._unpacked is None:
            self._unpacked = unpack_bf16_weight(self.weight, self.out_features, self.in_features).float()
        y = x.float().to(torch.bfloat16).float() @ self._unpacked.T
        return y if self.bias is None else y + self.bias


W8A8_GROUP = 32  # inputs per group: the weights' a and b, the activations' scale (csrc/w8a8_linear.cpp kGroup)
W8A8_PANEL = 16  # output columns per packed panel (kPanel)
W8A8_OUTLIERS = 4  # activation inputs per row kept exact (kOutliers)


def pack_w8a8_weight(codes: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``w = a * u + b`` per group of 32 inputs (codes u ``[N, K]`` in 0..255, a and b
    ``[N, ceil(K / 32)]``) -> (uint8 ``[Np / 16, Kp / 4, 16, 4]``, fp32 ``[Np / 16, Kp / 32, 2,
    16]``): the codes in panels of 16 output columns by 4 inputs (one 512-bit load is what
    vpdpbusd multiplies with a broadcast word of 4 int8 activations), and per group the 16
    columns' a, then their b. Np is N rounded up to 16, Kp K rounded up to 32; the padding is
    code 0 with a = b = 0."""
    n, k = codes.shape
    n_pad, k_pad = -(-n // W8A8_PANEL) * W8A8_PANEL, -(-k // W8A8_GROUP) * W8A8_GROUP
    groups = k_pad // W8A8_GROUP
    if a.shape != (n, groups) or b.shape != (n, groups):
        raise ValueError(f"a and b must be [{n}, {groups}], got {tuple(a.shape)} and {tuple(b.shape)}")
    if codes.numel() and (codes.min() < 0 or codes.max() > 255):
        raise ValueError("codes must lie in 0..255")
    u = nn.functional.pad(codes.to(torch.int32), (0, k_pad - k, 0, n_pad - n)).to(torch.uint8)
    packed = u.view(n_pad // W8A8_PANEL, W8A8_PANEL, k_pad // 4, 4).permute(0, 2, 1, 3)
    affine = nn.functional.pad(torch.stack([a.float(), b.float()]), (0, 0, 0, n_pad - n))  # [2, Np, G]
    affine = affine.view(2, n_pad // W8A8_PANEL, W8A8_PANEL, groups).permute(1, 3, 0, 2)
    return packed.contiguous(), affine.contiguous()


def unpack_w8a8_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_w8a8_weight's codes: int32 ``[n, k]`` in 0..255."""
    panels, quads = packed.shape[:2]
    full = packed.permute(0, 2, 1, 3).reshape(panels * W8A8_PANEL, quads * 4)
    return full[:n, :k].to(torch.int32)


def unpack_w8a8_affine(affine: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_w8a8_weight's a and b as fp32 ``[n, Kp / 32]`` each: row i's group g at ``[i, g]``."""
    full = affine.permute(2, 0, 3, 1).reshape(2, -1, affine.shape[1])
    return full[0, :n], full[1, :n]


def affine_min_max(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit asymmetric min/max codes of each group of 32 input weights (K padded with zeros):
    (codes ``[N, K]`` in 0..255, a, b ``[N, ceil(K / 32)]``), ``w ~ a * u + b`` to half a step."""
    n, k = weight.shape
    k_pad = -(-k // W8A8_GROUP) * W8A8_GROUP
    w = nn.functional.pad(weight.detach().float(), (0, k_pad - k)).view(n, -1, W8A8_GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    a = (hi - lo) / 255.0
    codes = torch.round((w - lo[..., None]) / torch.where(a > 0, a, 1.0)[..., None]).clamp(0, 255)
    return codes.view(n, k_pad)[:, :k].to(torch.int32), a, lo


def w8a8_activations(x: torch.Tensor, padded_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """The W8A8 kernel's activations in plain torch. Each row's ``min(4, K)`` largest magnitudes
    (of equal ones, the lower index; a NaN counts as infinite) are its outliers, kept exact; the
    rest (a NaN or inf among it read as 0), zero-padded to ``padded_k``, is rounded per group of 32 inputs to integers in
    -127..127 against the group's largest magnitude (``x * (127 / max)``, ties to even).
    Returns (the integers ``[M, padded_k]`` with the outliers zeroed, the scales ``max / 127``
    ``[M, padded_k / 32]``, the outliers' indices ``[M, R]`` ascending, their values ``[M, R]``)."""
    m, k = x.shape
    x = x.float()
    r = min(W8A8_OUTLIERS, k)
    magnitude = x.abs().nan_to_num(nan=float("inf"), posinf=float("inf"))  # a NaN counts as the largest
    order = torch.sort(magnitude, dim=1, descending=True, stable=True).indices  # stable: lower index first
    index = order[:, :r].sort(dim=1).values
    values = x.gather(1, index)
    rest = x.scatter(1, index, 0.0)
    rest = torch.where(rest.isfinite(), rest, 0.0)  # (a NaN or inf past the outliers reads as 0)
    groups = nn.functional.pad(rest, (0, padded_k - k)).view(m, padded_k // W8A8_GROUP, W8A8_GROUP)
    amax = groups.abs().amax(dim=-1)
    readable = amax > 127.0 / torch.finfo(torch.float32).max  # (below: 127 / max overflows; zeros)
    # (A tensor divided, not 127.0 / tensor: torch computes that as reciprocal * 127, another
    # rounding than the kernel's 127.f / amax.)
    inv = torch.where(readable, torch.full_like(amax, 127.0) / torch.where(readable, amax, 1.0), 0.0)
    return torch.round(groups * inv[..., None]).view(m, padded_k), amax / 127.0, index.to(torch.int32), values


class W8A8Linear(nn.Module):
    """Weights as byte codes with per-group constants, ``w = a * u + b`` per output column and
    group of 32 inputs, times int8 activations (one scale per row and group of 32 inputs, each
    row's 4 largest magnitudes kept exact), summed as integers (kvserve/csrc/w8a8_linear.cpp;
    batch invariant, as the other kernels): int4 mode's prompt rows with ``int4_prefill="int8"``,
    a copy of each block-quantized layer (``DecodeFormatLinear.add_prefill_copy``).

    The codes are the block formats' own (``DecodeFormatLinear.affine_codes``: Q4_1, Q4_K, Q5_0,
    Q8_0), so the copy holds the decode weights exactly, in 1.25 bytes per weight against a bf16
    copy's 2; only the activations are rounded. With AVX512-VNNI, vpdpbusd multiplies twice the
    pairs per instruction that vdpbf16ps does. With AVX2 (no VNNI), vpmaddubsw multiplies 32
    byte pairs per instruction, four times an fp32 FMA's 8, its int16 sums added as deep as each
    panel's largest code allows (``largest_codes``): on a 2-core Zen 3 the decoder GEMMs at 256
    rows ran 1.54-1.70x (SmolLM2) and 1.26-1.75x (Gemma 3, by layer kind) faster than through
    the bf16 copies (benchmarks/results/zen3-avx2-w8a8). Without either, the same bits come from
    a scalar loop: slower than the bf16 copies.

    Measured on Zen 4 (benchmarks/results/zen4-int8-exact-codes): the decoder GEMMs at 256 rows
    1.21x (SmolLM2) / 1.19x (Gemma 3) faster than through bf16 copies; prompt rows' top-1 agreement with the fp32 model
    98.7 % (SmolLM2) / 99.0 % (Gemma 3) on tests/test_precision.py's text, KL 0.0005 / 0.0004
    (bf16 copies 99.7 % / 99.4 %, 0.0001). The earlier version, weights rounded to int8 per 64
    inputs, was 1.35x faster and 97.8 % / 97.8 %, KL 0.002: its epilogue was one scale per 64
    inputs, this one a scale and an offset per 32.
    """

    def __init__(self, codes: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        packed, affine = pack_w8a8_weight(codes, a, b)
        self.register_buffer("weight", packed)
        self.register_buffer("affine", affine)
        self.register_buffer("bias", _fp32_bias(bias))
        # Each panel's largest code: how deep the AVX2 kernel may add its int16 sums.
        self.register_buffer("largest_codes", packed.view(packed.shape[0], -1).amax(dim=1))

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> "W8A8Linear":
        """Float weights rounded to 8-bit codes per group of 32 (``affine_min_max``)."""
        return cls(*affine_min_max(weight), bias)

    def weight_values(self) -> torch.Tensor:
        """The weights ``a * u + b`` as fp32 ``[N, K]`` (the block formats' values exactly; the
        kernel's outlier products compute ``fma(u, a, b)``, the same where ``u * a`` is exact)."""
        codes = unpack_w8a8_weight(self.weight, self.out_features, self.in_features).float()
        a, b = (t.repeat_interleave(W8A8_GROUP, dim=1)[:, :self.in_features]
                for t in unpack_w8a8_affine(self.affine, self.out_features))
        return torch.addcmul(b, codes, a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        return _block_quantized_forward(
            self, x, lambda ext, rows: ext.w8a8_linear(rows, self.weight, self.affine, n, self.bias, self.largest_codes))

    def forward_into(self, x: torch.Tensor, buffer: Callable[[int], torch.Tensor]) -> Optional[torch.Tensor]:
        """``self(x)`` written by the kernel into ``buffer(rows)``; None off the kernel."""
        return _block_quantized_forward_into(
            self, x, buffer, True, lambda ext, rows, out: ext.w8a8_linear_out(out, rows, self.weight, self.affine, self.bias,
                                                             self.largest_codes))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's sums in plain torch: the same integers (exact, in float64), the groups'
        scales and constants and the outliers' exact values times their weights applied in
        float64 (equal to the kernel's fp32 to rounding)."""
        k_pad = self.weight.shape[1] * 4
        q, scale, index, values = w8a8_activations(x, k_pad)
        codes = unpack_w8a8_weight(self.weight, self.out_features, k_pad).double()
        a, b = (t.double() for t in unpack_w8a8_affine(self.affine, self.out_features))  # [N, G]
        groups = q.double().view(q.shape[0], -1, W8A8_GROUP)
        sums = torch.einsum("mgk,ngk->mng", groups, codes.view(self.out_features, -1, W8A8_GROUP))
        scale = scale.double()[:, None, :]
        y = (sums * scale * a[None] + groups.sum(-1)[:, None, :] * scale * b[None]).sum(-1)
        index = index.long()
        outlier_weights = codes[:, index] * a[:, index // W8A8_GROUP] + b[:, index // W8A8_GROUP]  # [N, M, R]
        y = (y + torch.einsum("nmr,mr->mn", outlier_weights, values.double())).float()
        return y if self.bias is None else y + self.bias


class Fp32Linear(nn.Module):
    """fp32 weights (``--quantization none``, and the fp32 LM head) through kvserve's kernel
    (csrc/dense_linear.cpp): one 16-lane dot product per output in ascending k and a fixed
    horizontal sum, so a row's result does not depend on how many rows share the call. MKL's
    sgemm, which ``F.linear`` calls, does (measured: every row count > 1 changes the bits).
    The weight is used as stored (it may be the tied embedding table): no copy."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.weight = weight if weight.is_contiguous() else nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and ops.cpu_extension() is not None:
            return _block_quantized_forward(self, x, lambda ext, rows: ext.fp32_linear(rows, self.weight, self.bias))
        return self.forward_reference(x)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def use_invariant_fp32_linears(model: nn.Module) -> int:
    """Swap the fp32 ``nn.Linear`` layers of a CPU model (LM head included) for Fp32Linear,
    sharing their weights; how many were swapped. Nothing without the extension."""
    if ops.load_extension() is None or not batch_invariant_linears():
        return 0
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, Fp32Linear(module.weight, module.bias))
            swapped += 1
    return swapped


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 act_dtype: torch.dtype = _KERNEL_DTYPE) -> None:
        super().__init__()
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(act_dtype))
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, features]: the step's prompt rows through the prefill weights when the
        layer has them and the step's roles are installed, every other row through the blocks."""
        roles = None if self.prefill is None else current_token_roles()
        if roles is None:
            return self.forward_blocks(x)
        return roles.apply(x, self.prefill, self.forward_blocks)

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


def _fp32_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.detach().float().contiguous()


NIBBLE_TILE_ROWS = 16  # csrc/nibble_tiles.h kTileRows


def widened_bf16_kernel() -> bool:
    """Whether Bf16Linear runs kvserve's kernel on its widened AVX512 route here (bf16 weights
    widened to fp32 for 16-lane FMAs: Intel's cores), rather than vdpbf16ps, AVX2, oneDNN."""
    ext = ops.load_extension()
    return ext is not None and batch_invariant_linears() and ext.bf16_kernel_route() == "widened512"


def tiled_nibble_kernels() -> bool:
    """Whether this machine's nibble kernel (Q4_1, Q4_K, Q5_0) reads the tiled layout
    (``tile_nibbles``): the AVX512 and AVX2 kernels do (the same integers and the same fp32
    operations, so the same outputs); the portable loop reads rows."""
    return ops.nibble_kernel_isa() in ("avx512", "avx2")


def tile_nibbles(values: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor],
                 fp32_scales: bool = False) -> torch.Tensor:
    """Nibble-format weights in the AVX512 and AVX2 kernels' tiled layout (csrc/quant_linear.cpp): uint8
    ``[ceil(N / 16), groups, 320 | 384 | 352]``. Per tile of 16 output rows and group of 32
    inputs: 256 bytes of nibbles (byte ``64 i + 4 r + c``: row r's value ``4 i + c`` in its low
    nibble, ``16 + 4 i + c`` in its high one), then for Q4 (``m`` given) the rows' ``d`` and ``m``
    (fp16, or fp32 with ``fp32_scales``), for Q5_0 (``m`` None, values ``q + 16`` in 0..31) 8
    masks of the fifth bits (uint64, bit ``4 r + c`` of mask ``4 half + i``) then ``d`` (fp16).

    ``values`` ``[N, groups * 32]`` integers, ``d`` and ``m`` ``[N, groups]``; rows past N are zeros.
    The same bytes per weight as the row layout; the same nibbles as the LM-head screen's tiles."""
    n, k = values.shape
    groups, tiles, rows = k // INT4_GROUP_SIZE, -(-n // NIBBLE_TILE_ROWS), NIBBLE_TILE_ROWS
    v = torch.zeros(tiles * rows, k, dtype=torch.uint8)  # (bytes throughout: a model's worth at load)
    v[:n] = values.to(torch.uint8)
    v = v.view(tiles, rows, groups, 2, 4, 4)  # (tile, row, group, half, i, c): value 16 half + 4 i + c
    low = v & 15
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 256)
    parts = [nibbles]
    if m is None:
        bits = ((v >> 4) & 1).permute(0, 2, 3, 4, 1, 5).reshape(tiles, groups, 64, 8)  # (mask byte, bit)
        mask_bytes = torch.zeros(tiles, groups, 64, dtype=torch.uint8)
        for bit in range(8):
            mask_bytes |= bits[..., bit] << bit
        parts.append(mask_bytes)

    def per_row(scale: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(tiles * rows, groups)
        padded[:n] = scale.float()
        padded = padded.view(tiles, rows, groups).permute(0, 2, 1)
        return padded.to(torch.float32 if fp32_scales else torch.float16).contiguous().view(torch.uint8)

    parts += [per_row(d)] + ([] if m is None else [per_row(m)])
    return torch.cat(parts, dim=-1).contiguous()


def untile_nibbles(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``tile_nibbles``' inverse: (values int32 ``[N, groups * 32]``, d, m fp32 ``[N, groups]``;
    m None for Q5_0)."""
    tiles, groups, group_bytes = packed.shape
    rows, q5 = NIBBLE_TILE_ROWS, group_bytes == 352
    nib = packed[:, :, :256].reshape(tiles, groups, 4, rows, 4)  # (tile, group, i, row, c)
    v = torch.stack([nib & 15, nib >> 4], dim=2)  # (tile, group, half, i, row, c)
    offset = 256
    if q5:
        masks = packed[:, :, 256:320].reshape(tiles, groups, 64, 1)
        bits = (masks >> torch.arange(8, dtype=torch.uint8)) & 1
        v = v | (bits.reshape(tiles, groups, 2, 4, rows, 4) << 4)
        offset = 320
    values = v.permute(0, 4, 1, 2, 3, 5).reshape(tiles * rows, groups * INT4_GROUP_SIZE)[:n].to(torch.int32)
    scale_dtype = torch.float32 if group_bytes == 384 else torch.float16
    width = rows * torch.finfo(scale_dtype).bits // 8

    def per_row(start: int) -> torch.Tensor:
        scale = packed[:, :, start:start + width].contiguous().view(scale_dtype).float()  # (tile, group, row)
        return scale.permute(0, 2, 1).reshape(tiles * rows, groups)[:n]

    return values, per_row(offset), None if q5 else per_row(offset + width)


def quantize_min_max(weight: torch.Tensor, bits: int = 4,
                     group: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of each group of 32 input weights (as Q4_1): (q ``[N, K]``
    in 0..15, d, m ``[N, K / 32]`` fp32 holding fp16 values), ``w ~ d * q + m``. Other ``bits``
    and ``group`` sizes the same way (benchmarks/screen_rank.py tries coarser screens)."""
    n, k = weight.shape
    levels = float(2 ** bits - 1)
    w = weight.detach().float().view(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / levels).clamp(min=1e-6).half().float()
    m = lo.half().float()
    q = torch.round((w - m[..., None]) / d[..., None]).clamp(0, levels).view(n, k)
    return q, d, m


class Int4Linear(DecodeFormatLinear):
    """4-bit weights: per group of 32 input weights ``w = d * q + m``, ``q`` in 0..15, in GGUF
    Q4_1's byte layout: Q4_1 as stored (``d``, ``m`` fp16: 20 bytes per 32 weights), Q4_K with
    its group scales ``d * sc`` and offsets ``-dmin * mn`` in fp32 (exact; 24 bytes per 32
    against the file's 18), or a float checkpoint quantized min/max per group (as Q4_1).

    ``y = sum_g d_g * (q_g . x_g) + m_g * sum(x_g)``: the kernel streams the blocks once for all
    rows of the call, with the activations rounded to 16-bit integers per group of 32
    (``ops.nibble_kernel_activations``: finer than bf16) and multiplied as integers, exact per
    group (the weights' bytes times each activation's two bytes: vpdpbusd on AVX512, vpmaddubsw
    on AVX2), which needs no conversion of the weights to float (2x faster than bf16 products
    on both). The portable loops round the activations to bf16 instead: ``bf16(x) @ w.T``.

    Buffers, where the AVX512 or AVX2 kernel runs: ``packed`` (``tile_nibbles``: tiles of 16
    output rows, one per 32-bit lane of a vector, so that no row needs a horizontal sum; AVX2
    reads each as two 8-lane halves). Elsewhere the row layout: ``qs``
    uint8 ``[N, Kp / 2]`` (``Kp`` = K rounded up to 64 with zero groups; per group 16 bytes:
    weight j in the low nibble of byte j, j + 16 in its high nibble); ``dm`` ``[N, Kp / 64, 4]``
    = (d, d', m, m') of a chunk's two groups, as fp16 bits (int16) or fp32.
    """

    def __init__(self, qs: torch.Tensor, dm: torch.Tensor, in_features: int, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = qs.shape[0], in_features
        self.fp32_scales = dm.dtype == torch.float32
        self.register_buffer("bias", _fp32_bias(bias))
        tiled = tiled_nibble_kernels()  # the same weights, in the AVX512/AVX2 kernels' layout only
        self.register_buffer("packed", tile_nibbles(self._row_values(qs).view(qs.shape[0], -1),
                                                    *self._row_scales(qs, dm), self.fp32_scales) if tiled else None)
        self.register_buffer("qs", None if tiled else qs.contiguous())
        self.register_buffer("dm", None if tiled else dm.contiguous())

    def prefill_copy_pays(self) -> bool:
        """Not for the AVX512 tiles against kvserve's bf16 kernel on its widened route (Intel's
        cores, where vdpbf16ps runs at a quarter of the FMA rate): per 16 rows x 4 inputs one
        vpdpbusd per activation byte against 4 fp32 FMAs. Measured on a Xeon without AMX, 256
        rows: SmolLM2's 30 decoder layers 198 ms through the tiles against 245 ms through the
        copies (min of 7); Gemma 3's Q4_K layers 0.92-0.94x the copies' time. On the dot route
        (Zen 4) or through oneDNN (``KVSERVE_BATCH_INVARIANT=0``, AMX) the copies stay."""
        return not (self.packed is not None and widened_bf16_kernel())

    @staticmethod
    def _row_scales(qs: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, kp = qs.shape[0], qs.shape[1] * 2
        dm = (dm.view(torch.float16) if dm.dtype == torch.int16 else dm).float().view(n, kp // 64, 2, 2)
        return dm[:, :, 0].reshape(n, kp // 32), dm[:, :, 1].reshape(n, kp // 32)

    @staticmethod
    def _row_values(qs: torch.Tensor) -> torch.Tensor:
        n, kp = qs.shape[0], qs.shape[1] * 2
        groups = qs.view(n, kp // 32, 16)
        return torch.cat([groups & 15, groups >> 4], dim=-1)  # weights 0-15, then 16-31

    def _blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q ``[N, Kp]``, d, m ``[N, Kp / 32]``) from whichever layout the layer holds."""
        if self.packed is not None:
            return untile_nibbles(self.packed, self.out_features)
        return self._row_values(self.qs).view(self.out_features, -1), *self._row_scales(self.qs, self.dm)

    def dequantized(self) -> torch.Tensor:
        """The weights ``d * q + m`` as fp32 ``[N, K]`` (computed afresh: not kept)."""
        values, d, m = self._blocks()
        values = values.view(self.out_features, -1, INT4_GROUP_SIZE).float()
        return (values * d[..., None] + m[..., None]).view(self.out_features, -1)[:, :self.in_features]

    def affine_codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values, d, m = self._blocks()
        groups = -(-self.in_features // INT4_GROUP_SIZE)
        return values[:, :self.in_features].to(torch.int32), d[:, :groups].float(), m[:, :groups].float()

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: Optional[torch.Tensor],
                    fp32_scales: bool = False) -> "Int4Linear":
        """``q``: [N, K] in 0..15; ``d``, ``m``: [N, K / 32] (rounded to fp16 unless ``fp32_scales``)."""
        n, k = q.shape
        kp = -(-k // 64) * 64
        padded = torch.zeros(n, kp, dtype=torch.int32)
        padded[:, :k] = q.to(torch.int32)
        halves = padded.view(n, kp // 32, 2, 16)
        qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).reshape(n, kp // 2)
        scales = torch.zeros(2, n, kp // 32)
        scales[0, :, :k // 32], scales[1, :, :k // 32] = d, m
        dm = scales.view(2, n, kp // 64, 2).permute(1, 2, 0, 3).reshape(n, kp // 64, 4)
        return cls(qs, dm.float() if fp32_scales else dm.to(torch.float16).view(torch.int16), k, bias)

    @classmethod
    def from_nibble_blocks(cls, blocks: block_formats.NibbleBlocks, bias: Optional[torch.Tensor]) -> "Int4Linear":
        return cls.from_blocks(torch.from_numpy(blocks.q.astype(np.int32)), torch.from_numpy(blocks.d),
                               torch.from_numpy(blocks.m), bias, fp32_scales=blocks.fp32_scales)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> "Int4Linear":
        """Asymmetric min/max quantization of each group of 32 input weights (as Q4_1)."""
        return cls.from_blocks(*quantize_min_max(weight), bias)

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Every row through the 4-bit blocks."""
        if self.packed is not None:
            return _block_quantized_forward(
                self, x, lambda ext, rows: ext.tiled_nibble_linear(rows, self.packed, self.out_features, self.bias))
        return _block_quantized_forward(self, x, lambda ext, rows: ext.q4_linear(rows, self.qs, self.dm, self.bias))


class Q5Linear(DecodeFormatLinear):
    """GGUF Q5_0 weights as stored (22 bytes per 32): ``w = d * (q - 16)``, ``q`` in 0..31, ``d``
    fp16. The kernel is the 4-bit one's with the fifth bit added to each value. Where the AVX512
    or AVX2 kernel runs, ``packed`` (``tile_nibbles``, the fifth bits as one mask per 64 bytes of
    nibbles); elsewhere the low 4 bits in Q4_1's nibble layout and the fifth bits (a 32-bit word
    per group in the file) regrouped per 128 weights (``block_formats.q5_plane_masks``)."""

    def __init__(self, blocks: block_formats.Q5Blocks, in_features: int, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.qs.shape[0], in_features
        self.register_buffer("bias", _fp32_bias(bias))
        if tiled_nibble_kernels():  # the AVX512/AVX2 kernels' layout only: v = q + 16 in 0..31
            values = torch.from_numpy(block_formats.q5_codes(blocks) + 16).view(self.out_features, -1)
            d = torch.from_numpy(blocks.d.view(np.float16).astype(np.float32))
            self.register_buffer("packed", tile_nibbles(values, d, None))
            for name in ("qs", "qh", "d"):
                self.register_buffer(name, None)
            return
        self.register_buffer("packed", None)
        self.register_buffer("qs", torch.from_numpy(np.ascontiguousarray(blocks.qs)))
        # The fifth bits regrouped per 128 weights, as the portable loop reads them.
        self.register_buffer("qh", torch.from_numpy(np.ascontiguousarray(block_formats.q5_plane_masks(blocks.qh))))
        self.register_buffer("d", torch.from_numpy(np.ascontiguousarray(blocks.d)))

    def _file_blocks(self) -> block_formats.Q5Blocks:
        qh = block_formats.q5_fifth_bits(self.qh.numpy(), self.d.shape[1])
        return block_formats.Q5Blocks(self.qs.numpy(), qh, self.d.numpy())

    def dequantized(self) -> torch.Tensor:
        if self.packed is not None:
            values, d, _ = untile_nibbles(self.packed, self.out_features)
            w = (values.view(self.out_features, -1, INT4_GROUP_SIZE) - 16).float() * d[..., None]
            return w.view(self.out_features, -1)[:, :self.in_features]
        return torch.from_numpy(block_formats.q5_values(self._file_blocks(), self.in_features))

    def affine_codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes ``q + 16`` in 0..31, a = d, b = -16 d."""
        if self.packed is not None:
            values, d, _ = untile_nibbles(self.packed, self.out_features)
        else:
            blocks = self._file_blocks()
            values = torch.from_numpy(block_formats.q5_codes(blocks) + 16).view(self.out_features, -1)
            d = torch.from_numpy(blocks.d.view(np.float16).astype(np.float32))
        groups = -(-self.in_features // INT4_GROUP_SIZE)
        d = d[:, :groups].float()
        return values[:, :self.in_features].to(torch.int32), d, -16.0 * d

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _block_quantized_forward(
                self, x, lambda ext, rows: ext.tiled_nibble_linear(rows, self.packed, self.out_features, self.bias))
        return _block_quantized_forward(
            self, x, lambda ext, rows: ext.q5_linear(rows, self.qs, self.qh, self.d, self.bias))


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


class SegmentedLinear(DecodeFormatLinear):
    """Consecutive runs of output rows in different formats: a fused projection whose parts the
    file stores in different types (Gemma 3's q/k in Q5_0 and v in Q8_0 in half its layers).
    Each segment computes its rows; the prefill copy, when added, covers them all."""

    def __init__(self, segments: list[DecodeFormatLinear]) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self.in_features = segments[0].in_features
        self.out_features = sum(s.out_features for s in segments)
        biases = [s.bias for s in segments]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(s.out_features) for b, s in zip(biases, segments)])

    def dequantized(self) -> torch.Tensor:
        return torch.cat([s.dequantized() for s in self.segments])

    def affine_codes(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        parts = [s.affine_codes() for s in self.segments]
        if any(part is None for part in parts):
            return None
        return tuple(torch.cat(column) for column in zip(*parts))

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([s.forward_blocks(x) for s in self.segments], dim=-1)

    def prefill_copy_pays(self) -> bool:
        return any(s.prefill_copy_pays() for s in self.segments)  # one copy covers every segment


def _block_quantized_forward(layer: nn.Module, x: torch.Tensor, kernel) -> torch.Tensor:
    """``layer(x)`` for kvserve's kernels (Int4Linear, Q8Linear, Bf16Linear, Fp32Linear): fp32 rows through the kernel
    (``kernel(extension, rows)``), or ``layer.forward_reference`` without the extension."""
    rows = x.reshape(-1, layer.in_features).float().contiguous()
    ext = ops.cpu_extension()
    y = kernel(ext, rows) if ext is not None and rows.device.type == "cpu" else layer.forward_reference(rows)
    return y.view(*x.shape[:-1], layer.out_features).to(x.dtype)


def _block_quantized_forward_into(layer: nn.Module, x: torch.Tensor, buffer: Callable[[int], torch.Tensor],
                                  on_kernel: bool, kernel) -> Optional[torch.Tensor]:
    """``layer(x)`` into ``buffer(rows)`` through ``kernel(extension, rows, out)`` when the layer
    runs on kvserve's kernels (``on_kernel``) and ``x`` is fp32 on the CPU; else None."""
    ext = ops.cpu_extension()
    if not on_kernel or ext is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    rows = x.reshape(-1, layer.in_features).contiguous()
    out = buffer(rows.shape[0])
    kernel(ext, rows, out)
    return out


SCREEN_GROUP = 64  # inputs per group of the screen's weights and activations (csrc/screen_linear.cpp kGroup)


def screen_activations(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The screen kernel's activations: each group (last dimension, 64 inputs) rounded to
    integers in -127..127 against its largest magnitude, as the kernel computes them
    (``x * (1 / scale)``, ties to even; a NaN input ignored by the maximum, and a NaN or inf
    input's integer 0); (the integers, the groups' scales)."""
    inf = float("inf")
    scale = groups.nan_to_num(nan=0.0, posinf=inf, neginf=-inf).abs().amax(-1) / 127.0
    inv = torch.where(scale > 0, torch.full_like(scale, 1.0) / torch.where(scale > 0, scale, 1.0), 0.0)
    scaled = groups * inv[..., None]
    return torch.where(scaled.isfinite(), torch.round(scaled).clamp(-127, 127), 0.0), scale


class Q4Screen(nn.Module):
    """Approximate logits for ranking only: the weights at 4 bits (asymmetric min/max per group
    of 64, ``d`` and ``m`` fp16: 0.5625 bytes a weight, against Q8_0's 1.06) times activations
    rounded to int8 per group of 64, summed as integers (kvserve/csrc/screen_linear.cpp).

    Too coarse for logits (SmolLM2's head: mean error 0.4 against fp32) but a good ranking:
    the fp32 argmax ranked at most 12th on the real models' texts (benchmarks/screen_rank.py).
    ``packed``: uint8 ``[ceil(N / 16), K / 64, 576]``, per tile of 16 rows and group of 64
    inputs two blocks of nibbles in ``tile_nibbles``' layout (inputs 0-31, then 32-63), then the
    16 rows' ``d``, then their ``m``, as fp16.
    """

    def __init__(self, packed: torch.Tensor, out_features: int) -> None:
        super().__init__()
        self.register_buffer("packed", packed.contiguous())
        self.out_features, self.in_features = out_features, packed.shape[1] * SCREEN_GROUP

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Q4Screen":
        n, k = weight.shape
        if k % SCREEN_GROUP:
            raise ConfigError(f"the 4-bit screen needs in_features divisible by {SCREEN_GROUP}, got {k}")
        packed = _packed_by_kernel("q4_screen_pack", weight)  # (the torch ops take seconds for Gemma 3's head)
        return cls(packed if packed is not None else cls.pack_reference(weight), n)

    @staticmethod
    def pack_reference(weight: torch.Tensor) -> torch.Tensor:
        """``packed`` for ``weight`` [N, K] in plain torch (the extension's q4_screen_pack)."""
        k = weight.shape[1]
        q, d, m = quantize_min_max(weight, 4, SCREEN_GROUP)
        # tile_nibbles' 32-input groups, each carrying its 64-group's d and m: keep both blocks'
        # nibbles and the first one's scales.
        halves = tile_nibbles(q, d.repeat_interleave(2, dim=1), m.repeat_interleave(2, dim=1))
        halves = halves.view(halves.shape[0], k // SCREEN_GROUP, 2, -1)
        return torch.cat([halves[:, :, 0, :256], halves[:, :, 1, :256], halves[:, :, 0, 256:]], dim=-1)

    def _blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q ``[N, K]`` in 0..15, d, m ``[N, K / 64]``) from ``packed``."""
        p = self.packed
        scales = p[:, :, 512:]
        halves = torch.stack([torch.cat([p[:, :, :256], scales], -1), torch.cat([p[:, :, 256:512], scales], -1)], 2)
        values, d, m = untile_nibbles(halves.view(p.shape[0], -1, 320), self.out_features)
        return values, d[:, ::2], m[:, ::2]

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Approximate logits ``[rows, N]``, written into ``out`` (float32, that shape) when given."""
        rows = x.reshape(-1, self.in_features).float().contiguous()
        ext = ops.cpu_extension()
        if ext is not None and rows.device.type == "cpu":
            if out is None:
                return ext.q4_screen_linear(rows, self.packed, self.out_features)
            ext.q4_screen_linear_out(out, rows, self.packed)
            return out
        y = self.forward_reference(rows)
        return y if out is None else out.copy_(y)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's arithmetic in plain torch (other summation order)."""
        groups = self.packed.shape[1]
        values, d, m = self._blocks()
        q = values.view(self.out_features, groups, SCREEN_GROUP).float()
        scales = torch.stack([d, m])
        xg = x.float().view(x.shape[0], groups, SCREEN_GROUP)
        xq, dx = screen_activations(xg)
        dots = torch.einsum("sgj,ngj->sng", xq, q)
        return (dots * scales[0][None] * dx[:, None]).sum(-1) + xg.sum(-1) @ scales[1].T


class RescoredLMHead(nn.Module):
    """A low-precision LM head whose top candidates are recomputed with the fp32 weights.

    The cheap head ranks the whole vocabulary; the ``top_k`` best of each row get exact fp32
    logits (a [rows, top_k, hidden] gather and one batched dot product), so argmax and the top
    logprobs match an fp32 head unless the true best token fell outside the top k.

    With a ``screen`` (Q4Screen), a step that needs only each row's argmax (``argmax_only``:
    greedy rows that ask for nothing else) ranks with the screen instead, in about half the
    bytes, and its ``SCREEN_TOP_K`` best get fp32 logits; every other logit is -inf, so the
    argmax is the fp32 argmax unless the true best ranked below the candidates.
    """

    def __init__(self, fast: nn.Module, exact_weight: RowSource, top_k: int = LM_HEAD_RESCORE_TOP_K,
                 screen: Optional[Q4Screen] = None) -> None:
        super().__init__()
        self.fast = fast
        # fp32 [vocab, hidden], or the Q8Table of its blocks (kvserve.row_table); shared with the
        # embedding table when tied.
        self.exact_weight = exact_weight
        self.top_k = top_k
        self.screen = screen
        self._kept_logits: Optional[torch.Tensor] = None  # see _kept_buffer

    def native_screen(self, rows: int, x: torch.Tensor) -> Optional[tuple]:
        """(logits buffer, screen weights, exact weights, their Q8_0 scales or None, top_k): the
        arguments of forward's one-call argmax path (``screened_logits_out``) for ``rows`` rows
        like ``x`` (fp32, on x's device), or None where forward takes another path."""
        exact, exact_scales = table_args(self.exact_weight)
        if (self.screen is None or not rows or not ops.enabled_for(x)
                or (exact_scales is None and exact.dtype != torch.float32) or not exact.is_contiguous()):
            return None
        out = self._kept_buffer(rows, self.screen.out_features, x)
        return out, self.screen.packed, exact, exact_scales, min(SCREEN_TOP_K, out.shape[-1])

    def argmax_tokens(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Each row's argmax of ``self(x, argmax_only=True)`` as int64 ``[rows]`` (the token
        ``ops.argmax`` takes from those logits), without writing the rows of -inf around the
        candidates (``screened_argmax_out``); None where ``forward`` would not take the native
        screen."""
        call = self.native_screen(x.shape[0], x) if x.dim() == 2 and x.is_contiguous() else None
        if call is None:
            return None
        tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        ops.cpu_extension().screened_argmax_out(tokens, call[0], x, *call[1:])
        return tokens

    def _kept_buffer(self, rows: int, columns: int, x: torch.Tensor) -> torch.Tensor:
        """The transient logits' memory, kept from call to call and grown as needed: what a
        transient call returns is valid until the next one (the runner samples from it in the
        same step). A fresh tensor this size (Gemma 3: 1 MB per row) comes from mmap once past
        glibc's 32 MB threshold, and its first touch faulted ~8 ms into a 32-row decode step."""
        buf = self._kept_logits
        if (buf is None or buf.shape[0] < rows or buf.shape[1] != columns or buf.device != x.device
                or buf.is_inference() != torch.is_inference_mode_enabled()):
            capacity = max(rows, 0 if buf is None or buf.shape[1] != columns else buf.shape[0])
            buf = self._kept_logits = torch.empty(capacity, columns, dtype=torch.float32, device=x.device)
        return buf[:rows]

    def _full_logits(self, x: torch.Tensor, transient: bool) -> torch.Tensor:
        """The fast head's logits of every token, into the kept buffer when ``transient`` and
        the fast head writes into one (kvserve's bf16 and Q8 kernels)."""
        forward_into = getattr(self.fast, "forward_into", None)
        if transient and forward_into is not None:
            logits = forward_into(x, lambda rows: self._kept_buffer(rows, self.fast.out_features, x))
            if logits is not None:
                return logits
        return self.fast(x).float()

    def forward(self, x: torch.Tensor, argmax_only: bool = False, transient: bool = False) -> torch.Tensor:
        """Logits ``[rows, vocabulary]``. ``argmax_only``: the caller reads only each row's argmax
        (the screen ranks; see the class). ``transient`` (implied by ``argmax_only``): the caller
        is done with the result before its next call here, which may write into the same memory."""
        screened = argmax_only and self.screen is not None
        if screened:
            rows = x.numel() // x.shape[-1]
            call = self.native_screen(rows, x) if x.dim() == 2 and x.is_contiguous() else None
            if call is not None:
                # The same kernels as below, in one native call (see screened_logits_out).
                ops.cpu_extension().screened_logits_out(call[0], x, *call[1:])
                return call[0]
            out = self._kept_buffer(rows, self.screen.out_features, x)
            top_k = min(SCREEN_TOP_K, out.shape[-1])
            logits = self.screen(x, out=out)
        else:
            logits, top_k = self._full_logits(x, transient or argmax_only), self.top_k
        if logits.shape[0] == 0:
            return logits
        idx = ops.top_k(logits, min(top_k, logits.shape[-1]))[1]  # [S, k]
        exact = gathered_rows_dot(x.float(), self.exact_weight, idx)
        if screened:
            logits.fill_(float("-inf"))
        return logits.scatter_(1, idx, exact)


def _gguf_block_linear(quant_type: str, data: np.ndarray, shape: tuple[int, ...],
                       bias: Optional[torch.Tensor]) -> Optional[DecodeFormatLinear]:
    """A GGUF matrix read by the kernel for its own type (None: no kernel reads that type)."""
    blocks = block_formats.unpack(quant_type, data, shape)
    if isinstance(blocks, block_formats.NibbleBlocks):
        return Int4Linear.from_nibble_blocks(blocks, bias)
    if isinstance(blocks, block_formats.Q5Blocks):
        return Q5Linear(blocks, shape[-1], bias)
    if isinstance(blocks, block_formats.ByteBlocks):
        return Q8Linear.from_byte_blocks(blocks, bias)
    return None


def gguf_linear(raw_parts: list, bias: Optional[torch.Tensor]) -> Optional[DecodeFormatLinear]:
    """The fused projection of ``raw_parts`` (GGUF QuantizedTensors stacked by rows) on the
    file's own blocks: one layer when the parts share a type, a SegmentedLinear of one layer
    per run of parts that share one otherwise; None if some part's type has no kernel."""
    runs: list[list] = []
    for part in raw_parts:
        if runs and runs[-1][0].quant_type == part.quant_type:
            runs[-1].append(part)
        else:
            runs.append([part])
    layers, row = [], 0
    for run in runs:
        rows = sum(p.shape[0] for p in run)
        data = run[0].data if len(run) == 1 else np.concatenate([p.data for p in run])
        layer = _gguf_block_linear(run[0].quant_type.name, data, (rows, run[0].shape[-1]),
                                   None if bias is None else bias[row:row + rows])
        if layer is None:
            return None
        layers.append(layer)
        row += rows
    return layers[0] if len(layers) == 1 else SegmentedLinear(layers)


def _format_name(raw_parts: list) -> str:
    types = "+".join(dict.fromkeys(p.quant_type.name for p in raw_parts))
    return f"{types} (as stored)"


def convert_linear_layers(model: nn.Module, weight_format: str,
                          raw_weights: Optional[dict] = None, int4_prefill: str = "auto") -> dict[str, int]:
    """Swap the decoder's linear layers and the LM head for ``weight_format`` ones.

    ``int4_prefill`` (INT4_PREFILL_MODES): which int4 layers also get prefill weights for the
    prompt tokens (``DecodeFormatLinear``), in which format: those where a bf16 copy pays here
    ("auto"), all in bf16 ("bf16"), all as byte codes under int8 activations ("int8": faster,
    the activations rounded, see W8A8Linear), or none ("blocks": a draft model, which runs every row through the
    blocks).

    ``raw_weights`` (HF name -> GGUF QuantizedTensor): int4 mode reads a GGUF's own blocks
    where a kernel reads their type (Q4_1, Q4_K, Q5_0, Q8_0, Q6_K: every value as stored), and
    keeps other GGUF matrices at bf16. Float checkpoints are quantized from their values
    (int4: asymmetric min/max per group of 32). int8 is symmetric per output channel.
    The LM head is Q8_0 in int4 mode and bf16 otherwise, with fp32 rescoring of its top
    candidates, and a 4-bit screen for steps that need only the argmax (RescoredLMHead).
    Returns how many layers got each format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight format {weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    if int4_prefill not in INT4_PREFILL_MODES:
        raise ConfigError(f"unknown int4 prefill mode {int4_prefill!r} (choose from {', '.join(INT4_PREFILL_MODES)})")
    packed = getattr(model, "packed_modules", {})
    raw_weights = raw_weights or {}
    counts: dict[str, int] = {}
    prefill_bytes = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        if module.weight.device.type != "cpu" and weight_format != "bf16":
            raise ConfigError("int8/int4 weights use CPU kernels; use --device cpu")
        leaf = name.rsplit(".", 1)[-1]
        raw = [raw_weights.get(f"{name.rsplit('.', 1)[0]}.{part}.weight")
               for part in packed.get(leaf, (leaf,))]
        if weight_format == "bf16":
            new, kind = Bf16Linear(module.weight, module.bias), "bf16"
        elif (weight_format == "int4" and all(r is not None for r in raw)
              and (blocks := gguf_linear(raw, module.bias)) is not None):
            new, kind = blocks, _format_name(raw)
        elif (weight_format == "int4" and module.in_features % INT4_GROUP_SIZE == 0
              and all(r is None for r in raw)):
            # Float checkpoints (safetensors, test models): quantize afresh.
            new, kind = Int4Linear.from_float(module.weight, module.bias), "int4"
        elif weight_format == "int4":
            # A GGUF matrix in a type no kernel reads (Q5_1, the other K-quants, IQ*):
            # requantizing it to 4 bits loses accuracy (Gemma 3's Q5_0/Q6_K/Q8_0 mix measured
            # 91 % top-1 agreement that way), so it stays at bf16.
            new, kind = Bf16Linear(module.weight, module.bias), "bf16 (no kernel for its type)"
        else:
            new, kind = Int8Linear(module.weight, module.bias), "int8"
        if isinstance(new, DecodeFormatLinear) and int4_prefill == "int8":
            prefill_bytes += new.add_prefill_copy("int8")
        elif isinstance(new, DecodeFormatLinear) and (
                int4_prefill == "bf16" or (int4_prefill == "auto" and new.prefill_copy_pays())):
            prefill_bytes += new.add_prefill_copy("bf16")
        counts[kind] = counts.get(kind, 0) + 1
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, new)
    exact = model.lm_head.weight
    on_cpu = exact.device.type == "cpu"
    # Greedy steps rank with a 4-bit screen where the kernel exists (its plain-torch reference
    # is far slower than the head it would replace).
    screen = (Q4Screen.from_float(exact) if on_cpu and exact.shape[1] % SCREEN_GROUP == 0
              and ops.load_extension() is not None else None)
    if weight_format == "int4" and on_cpu and exact.shape[1] % INT4_GROUP_SIZE == 0:
        # Q8_0, llama.cpp's format for SmolLM2's head: half the bytes of bf16 (1.0 against
        # 2.2 ms per token for its 28 M weights).
        model.lm_head, kind = RescoredLMHead(Q8Linear.from_float(exact), exact, screen=screen), "lm_head Q8_0"
    else:
        # bf16 otherwise: the packed bf16 matmul reads the head faster at one row than
        # torch's int8 kernel does (0.9-1.5 ms against 2.0 ms for SmolLM2's 28 M weights).
        model.lm_head, kind = RescoredLMHead(Bf16Linear(exact, None), exact, screen=screen), "lm_head bf16"
    kind += " + fp32 rescoring" + (" + 4-bit argmax screen" if screen is not None else "")
    counts[kind] = 1
    if prefill_bytes:
        logger.info("int4: %s prefill copies of the block-quantized layers for prompt tokens, %.1f MiB",
                    prefill_copy_format(model), prefill_bytes / 2**20)
    _weights_to_huge_pages(model)
    keep_embedding_as_blocks(model)
    return counts


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def _prefill_copies(model: nn.Module) -> Iterator[nn.Module]:
    """The prefill copies (Bf16Linear, W8A8Linear) of the model's block-quantized layers."""
    return (m.prefill for m in model.modules() if isinstance(m, DecodeFormatLinear) and m.prefill is not None)


def prefill_copy_bytes(model: nn.Module) -> int:
    """The bytes of the int4 layers' prefill weights (0: none)."""
    return sum(_buffer_bytes(copy) for copy in _prefill_copies(model))


def prefill_copy_format(model: nn.Module) -> Optional[str]:
    """The format of the int4 layers' prefill copies: "bf16", "int8" (or both, "bf16+int8"); None."""
    names = {W8A8Linear: "int8", Bf16Linear: "bf16"}
    return "+".join(sorted({names[type(copy)] for copy in _prefill_copies(model)})) or None


def has_prefill_copies(model: nn.Module) -> bool:
    """Whether some linear layer computes prompt rows in another format than generated ones."""
    return any(True for _ in _prefill_copies(model))


# The buffers each format streams per token, in the order a step reads them. (oneDNN's
# pre-packed bf16 weights are opaque tensors that cannot be placed.)
# (None where the layer holds the other layout.) The LM head's screen is read at every greedy
# argmax-only step: on 4 KB pages Gemma 3's 94 MB screen took 1.045x the time (median of 300 calls
# alternated with a huge-page copy, each after a 96 MB flood, Zen 3; SmolLM2's 16 MB: the same).
_STREAMED_BUFFERS = {Int4Linear: ("packed", "qs", "dm"), Q5Linear: ("packed", "qs", "qh", "d"), Q8Linear: ("qs", "d"),
                     Q4Screen: ("packed",)}


def _weights_to_huge_pages(model: nn.Module) -> None:
    """Move the block-quantized weights, in module (= reading) order, into one huge-page
    buffer (see ops.copy_to_huge_pages)."""
    slots = [(module, name) for module in model.modules() for name in _STREAMED_BUFFERS.get(type(module), ())
             if getattr(module, name) is not None]
    copies = ops.copy_to_huge_pages([getattr(module, name) for module, name in slots])
    for (module, name), copy in zip(slots, copies):
        setattr(module, name, copy)
