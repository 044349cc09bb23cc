"""GGUF's block-quantized weight formats, unpacked into the buffers kvserve's kernels read.

A GGUF matrix is stored row by row, each row a run of blocks: 32 weights (Q4_1, Q5_0, Q8_0)
or a 256-weight super-block of 16- or 32-weight groups (Q4_K, Q6_K). The kernels
(kvserve/csrc/quant_linear.cpp) read three layouts:

- nibbles (Q4_1, Q4_K): 4-bit values in Q4_1's byte layout, a scale and an offset per group
  of 32, ``w = d * q + m``;
- nibbles plus a fifth bit (Q5_0): ``w = d * (q - 16)``;
- bytes (Q8_0, Q6_K): signed 8-bit values and a scale per group of 32 or 16, ``w = d * q``.

Every value is kept exactly: a group's scale that the file stores as a product of two numbers
(Q4_K's ``d * sc``, ``dmin * m``; Q6_K's ``d * sc``) is kept in fp32, where the product is
exact. Q4_1, Q5_0 and Q8_0 keep their fp16 scales and their bits per weight; Q4_K takes
6 bits per weight here instead of 4.5 (fp32 scales per 32), Q6_K 10 instead of 6.56 (bytes
and fp32 scales per 16): a smaller kernel family for a few percent more bytes.

numpy only: each function takes a tensor's raw ``[rows, row_bytes]`` uint8 data and its
``[rows, columns]`` shape and is checked against gguf's own dequantization in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from gguf import GGMLQuantizationType

GROUP = 32  # weights per group (Q4_1, Q5_0, Q8_0, and Q4_K's sub-blocks)
SUPER_BLOCK = 256  # Q4_K, Q6_K


@dataclass
class NibbleBlocks:
    """``w = d * q + m`` per group of 32: q ``[N, K]`` in 0..15, d and m ``[N, K / 32]``
    (float32 holding fp16 values for Q4_1, any fp32 for Q4_K)."""
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray
    fp32_scales: bool


@dataclass
class Q5Blocks:
    """``w = d * (q - 16)`` per group of 32, stored as Q5_0 is: ``qs`` uint8 ``[N, Kp / 2]``
    (per group 16 bytes: weight j's low 4 bits in the low nibble of byte j, weight j + 16's in
    its high nibble), ``qh`` int32 ``[N, Kp / 32]`` (bit j: weight j's fifth bit), ``d`` the fp16
    bits (int16) ``[N, Kp / 32]``; Kp = K rounded up to 64 with zero groups."""
    qs: np.ndarray
    qh: np.ndarray
    d: np.ndarray


@dataclass
class ByteBlocks:
    """``w = d * q``: q int8 ``[N, K]``; d per group of 32 as fp16 bits (int16, Q8_0) or per
    group of 16 as fp32 (Q6_K)."""
    q: np.ndarray
    d: np.ndarray

    @property
    def group(self) -> int:
        return 16 if self.d.dtype == np.float32 else GROUP

    @property
    def scales(self) -> np.ndarray:
        """d as float32 ``[N, K / group]``."""
        return self.d.view(np.float16).astype(np.float32) if self.d.dtype == np.int16 else self.d


def _blocks(data: np.ndarray, shape: tuple[int, ...], weights_per_block: int, block_bytes: int) -> np.ndarray:
    n, k = shape[0], shape[-1]
    return np.ascontiguousarray(data).reshape(n, k // weights_per_block, block_bytes)


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at ``offset`` of every block, as float32."""
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 32-weight nibble layout ``[..., 16]`` bytes -> values ``[..., 32]``: weight j is
    byte j's low nibble, j + 16 its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack_q4_1(data: np.ndarray, shape: tuple[int, ...]) -> NibbleBlocks:
    """Q4_1: ``half d, half m, uint8 qs[16]`` per 32 weights."""
    n, k = shape[0], shape[-1]
    blocks = _blocks(data, shape, GROUP, 20)
    q = _nibbles(blocks[..., 4:]).reshape(n, k)
    return NibbleBlocks(q, _fp16(blocks, 0), _fp16(blocks, 2), fp32_scales=False)


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit (scale, min) pairs for its 8 groups -> two ``[..., 8]`` arrays
    (ggml's get_scale_min_k4)."""
    s = scales.astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def unpack_q4_k(data: np.ndarray, shape: tuple[int, ...]) -> NibbleBlocks:
    """Q4_K: ``half d, half dmin, uint8 scales[12], uint8 qs[128]`` per 256 weights; group g of
    32 is ``d * sc[g] * q - dmin * mn[g]``, its values the low nibbles of 32 bytes (even g) or
    the high nibbles of the same bytes (odd g)."""
    n, k = shape[0], shape[-1]
    blocks = _blocks(data, shape, SUPER_BLOCK, 144)
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(n, k // SUPER_BLOCK, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)  # per 64: low nibbles, then high
    group_d = (d[..., None] * sc).reshape(n, k // GROUP)  # fp32 products of fp16 and 6-bit: exact
    group_m = -(dmin[..., None] * mn).reshape(n, k // GROUP)
    return NibbleBlocks(q, group_d.astype(np.float32), group_m.astype(np.float32), fp32_scales=True)


def unpack_q5_0(data: np.ndarray, shape: tuple[int, ...]) -> Q5Blocks:
    """Q5_0: ``half d, uint32 qh, uint8 qs[16]`` per 32 weights, kept as stored (padded to a
    whole number of 64-weight chunks)."""
    n, k = shape[0], shape[-1]
    blocks = _blocks(data, shape, GROUP, 22)
    groups = k // GROUP
    padded = groups + groups % 2
    qs = np.zeros((n, padded, 16), np.uint8)
    qh = np.zeros((n, padded), np.uint32)
    d = np.zeros((n, padded), np.uint16)
    qs[:, :groups] = blocks[..., 6:]
    qh[:, :groups] = blocks[..., 2:6].copy().view("<u4")[..., 0]
    d[:, :groups] = blocks[..., 0:2].copy().view("<u2")[..., 0]
    return Q5Blocks(qs.reshape(n, padded * 16), qh.view(np.int32), d.view(np.int16))


def q5_codes(blocks: Q5Blocks) -> np.ndarray:
    """A Q5Blocks' ``q - 16`` (-16..15) as int32 ``[N, groups, 32]``."""
    n = blocks.qs.shape[0]
    low = _nibbles(blocks.qs.reshape(n, -1, 16)).astype(np.int32)  # [N, groups, 32]
    bits = (blocks.qh.view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return (low | (bits.astype(np.int32) << 4)) - 16


def q5_values(blocks: Q5Blocks, k: int) -> np.ndarray:
    """A Q5Blocks' weights ``[N, K]`` as float32."""
    n = blocks.qs.shape[0]
    w = (q5_codes(blocks) * blocks.d.view(np.float16).astype(np.float32)[..., None]).astype(np.float32)  # exact
    return w.reshape(n, -1)[:, :k]


def _plane_positions() -> tuple[np.ndarray, np.ndarray]:
    """For mask p, bit i of a 128-weight block (kvserve/csrc/quant_linear.cpp's planes): the
    group within the block and the weight within the group whose fifth bit it holds."""
    p, i = np.meshgrid(np.arange(4), np.arange(32), indexing="ij")
    return i // 8, 2 * (i % 8) + (p & 1) * 16 + (p >> 1)


def q5_plane_masks(qh: np.ndarray) -> np.ndarray:
    """Q5_0's fifth bits, ``qh`` [N, groups] (bit j of a group's word: weight j), regrouped as
    the portable loop reads them (csrc/quant_linear.cpp Q5Format; the AVX512 and AVX2 kernels
    read quant.tile_nibbles): [N, ceil(groups / 4) * 4] int32, four masks per 128-weight
    block. Same bits, other order (``q5_fifth_bits`` is the inverse)."""
    n, groups = qh.shape
    padded = np.zeros((n, -(-groups // 4) * 4), np.uint32)
    padded[:, :groups] = qh.view(np.uint32)
    bits = (padded.reshape(n, -1, 4)[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [N, B, group, j]
    group, weight = _plane_positions()
    plane_bits = bits[:, :, group, weight].astype(np.uint64)  # [N, B, plane, i]
    masks = (plane_bits << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return masks.reshape(n, -1).view(np.int32)


def q5_fifth_bits(masks: np.ndarray, groups: int) -> np.ndarray:
    """``q5_plane_masks``' inverse: the [N, groups] int32 qh words."""
    n = masks.shape[0]
    bits = (masks.view(np.uint32).reshape(n, -1, 4)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    group, weight = _plane_positions()
    per_group = np.zeros((n, bits.shape[1], 4, 32), np.uint64)
    per_group[:, :, group, weight] = bits
    qh = (per_group << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32).reshape(n, -1)
    return qh[:, :groups].view(np.int32)


def unpack_q8_0(data: np.ndarray, shape: tuple[int, ...]) -> ByteBlocks:
    """Q8_0: ``half d, int8 qs[32]`` per 32 weights, kept as stored."""
    n, k = shape[0], shape[-1]
    blocks = _blocks(data, shape, GROUP, 34)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return ByteBlocks(q, blocks[..., 0:2].copy().view("<i2")[..., 0])


def unpack_q6_k(data: np.ndarray, shape: tuple[int, ...]) -> ByteBlocks:
    """Q6_K: ``uint8 ql[128], uint8 qh[64], int8 scales[16], half d`` per 256 weights; group g
    of 16 is ``d * scales[g] * (q - 32)``, q's low 4 bits in ``ql``, its high 2 in ``qh``
    (ggml's dequantize_row_q6_K order)."""
    n, k = shape[0], shape[-1]
    blocks = _blocks(data, shape, SUPER_BLOCK, 210)
    ql = blocks[..., :128].reshape(n, -1, 2, 64).astype(np.int32)  # per 128-weight half: 64 bytes
    qh = blocks[..., 128:192].reshape(n, -1, 2, 32).astype(np.int32)
    quarters = [  # weights l, l + 32, l + 64, l + 96 of each half (l < 32)
        (ql[..., 0:32] & 0x0F) | ((qh & 3) << 4),
        (ql[..., 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4),
    ]
    q = (np.stack(quarters, axis=3) - 32).reshape(n, k).astype(np.int8)
    scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, blocks, 16]
    d = (_fp16(blocks, 208)[..., None] * scales).reshape(n, k // 16)  # fp16 x int8: exact in fp32
    return ByteBlocks(q, d.astype(np.float32))


def byte_values(blocks: ByteBlocks) -> np.ndarray:
    """A ByteBlocks' weights ``[N, K]`` as float32."""
    n, k = blocks.q.shape
    return (blocks.q.astype(np.float32).reshape(n, -1, blocks.group) * blocks.scales[..., None]).reshape(n, k)


def unpack_q4_0(data: np.ndarray, shape: tuple[int, ...]) -> NibbleBlocks:
    """Q4_0: ``half d, uint8 qs[16]`` per 32 weights, ``w = d * (q - 8)``: Q4_1's form with
    ``m = -8 d`` (exact in fp16)."""
    n, k = shape[0], shape[-1]
    blocks = _blocks(data, shape, GROUP, 18)
    q = _nibbles(blocks[..., 2:]).reshape(n, k)
    d = _fp16(blocks, 0)
    return NibbleBlocks(q, d, (-8.0 * d).astype(np.float16).astype(np.float32), fp32_scales=False)


UNPACKERS = {"Q4_0": unpack_q4_0, "Q4_1": unpack_q4_1, "Q4_K": unpack_q4_k, "Q5_0": unpack_q5_0, "Q8_0": unpack_q8_0, "Q6_K": unpack_q6_k}


def unpack(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> Optional[object]:
    """The kernel buffers of a GGUF matrix of type ``type_name`` (e.g. "Q5_0"), or None for a
    type no kernel reads."""
    unpacker = UNPACKERS.get(type_name)
    return None if unpacker is None else unpacker(data, shape)


@dataclass
class QuantizedTensor:
    """A weight as stored in the GGUF file, for weight-only quantized kernels to repack.

    ``data`` is uint8 ``[out_features, row_bytes]`` with rows already in HF order (the q/k
    permutation is a row gather, which commutes with row-wise quantization blocks).
    """

    quant_type: GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, ...]  # dequantized shape, [out_features, in_features]
