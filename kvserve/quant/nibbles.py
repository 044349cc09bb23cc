"""The nibble formats' shared layout: the AVX512/AVX2 kernels' tiles of 16 output rows (Q4_1,
Q4_K, Q5_0 and the LM head's screen), and min/max quantization to 4 bits."""
from __future__ import annotations

from typing import Optional

import torch

from kvserve import ops
from kvserve.quant.common import INT4_GROUP_SIZE

NIBBLE_TILE_ROWS = 16  # csrc/nibble_tiles.h kTileRows


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


Q4_K_SUPER_BYTES = 8 * (256 + 32) + 64  # csrc/quant_linear.cpp Q4KTiles::kSuperBytes
Q5_K_SUPER_BYTES = 8 * (256 + 64 + 32) + 64  # Q5KTiles::kSuperBytes (the fifth bits' masks after the nibbles)


def _untile_k_quant(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's or Q5_K's own tiles (block_repack.cpp) as (values, d * sc, -(dmin * mn)) per group of 32."""
    tiles, supers, super_bytes = packed.shape
    rows, masks = NIBBLE_TILE_ROWS, 64 if super_bytes == Q5_K_SUPER_BYTES else 0
    group_bytes = 256 + masks + 32
    groups = packed[:, :, :8 * group_bytes].reshape(tiles, supers * 8, group_bytes)  # the tile groups, in order
    # (through the Q5_0 layout: nibbles, masks, then 32 bytes of unused scales; zero masks for Q4_K)
    values, _, _ = untile_nibbles(torch.cat([groups[..., :256 + masks],
                                             torch.zeros(tiles, supers * 8, 96 - masks, dtype=torch.uint8)], dim=-1), n)
    sc = groups[..., 256 + masks:272 + masks].float().permute(0, 2, 1)  # (tile, row, group)
    mn = groups[..., 272 + masks:288 + masks].float().permute(0, 2, 1)
    halves = packed[:, :, 8 * group_bytes:].contiguous().view(torch.float16).float().view(tiles, supers, 2, rows)
    d = halves[:, :, 0].permute(0, 2, 1).repeat_interleave(8, dim=-1)  # (tile, row, group)
    dmin = halves[:, :, 1].permute(0, 2, 1).repeat_interleave(8, dim=-1)
    flat = lambda t: t.reshape(tiles * rows, supers * 8)[:n]  # noqa: E731
    return values, flat(d * sc), flat(-(dmin * mn))


def untile_nibbles(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``tile_nibbles``' inverse (and Q4_K's and Q5_K's own tiles'): (values int32 ``[N, groups * 32]``, d, m
    fp32 ``[N, groups]``; m None for Q5_0)."""
    if packed.shape[-1] in (Q4_K_SUPER_BYTES, Q5_K_SUPER_BYTES):
        return _untile_k_quant(packed, n)
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
