"""Byte codes with per-group constants under int8 activations (kvserve/csrc/w8a8_linear.cpp):
the int8 prefill copies of the block-quantized layers."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from kvserve.quant.common import _block_quantized_forward, _block_quantized_forward_into, _fp32_bias

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
