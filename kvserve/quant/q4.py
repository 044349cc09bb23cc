"""4-bit weights in Q4_1's layout: GGUF Q4_1 and Q4_K as stored, float checkpoints quantized."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from gguf import GGMLQuantizationType

from kvserve import block_formats, ops
from kvserve.quant.bf16 import widened_bf16_kernel
from kvserve.quant.common import INT4_GROUP_SIZE, _block_quantized_forward, _fp32_bias, read_only_parts
from kvserve.quant.decode_format import DecodeFormatLinear
from kvserve.quant.nibbles import quantize_min_max, tile_nibbles, tiled_nibble_kernels, untile_nibbles


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

    GGUF_RAW_TYPES: tuple[str, ...] = ("Q4_K", "Q4_1", "Q4_0")  # what from_gguf_raw reads

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
        (Zen 4) or through oneDNN (``KernelConfig(batch_invariant=False)``, AMX) the copies stay."""
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
    def from_gguf_raw(cls, data: np.ndarray, type_name: str, shape: tuple[int, ...],
                      bias: Optional[torch.Tensor]) -> Optional["Int4Linear"]:
        """The layer straight from a Q4_K, Q4_1 or Q4_0 tensor's bytes (``[N, row bytes]``) into the
        tiles, natively (block_repack.cpp: the values ``from_nibble_blocks`` gives, without its
        temporaries); None where the kernels read rows or the extension is absent."""
        ext = ops.load_extension()
        if ext is None or not tiled_nibble_kernels() or type_name not in cls.GGUF_RAW_TYPES:
            return None
        packed = ext.gguf_nibble_tiles(read_only_parts(data), int(GGMLQuantizationType[type_name]), shape[-1])
        layer = cls.__new__(cls)
        DecodeFormatLinear.__init__(layer)
        layer.out_features, layer.in_features = shape[0], shape[-1]
        layer.fp32_scales = type_name in ("Q4_K", "Q5_K")
        layer.register_buffer("bias", _fp32_bias(bias))
        layer.register_buffer("packed", packed)
        layer.register_buffer("qs", None)
        layer.register_buffer("dm", None)
        return layer

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


class Q5KLinear(Int4Linear):
    """GGUF Q5_K in its own bits (5.625 per weight against the file's 5.5): per group of 32,
    ``w = d * sc * q - dmin * mn`` with q in 0..31, the Q4_K tiles plus each group's fifth bits
    (csrc/quant_linear.cpp's KQuantTiles<true>), the nibble kernels with the bits added as Q5_0's
    are. Only where the tiled kernels run (``from_gguf_raw``); elsewhere a Q5_K matrix is held in
    bf16, as before."""

    GGUF_RAW_TYPES = ("Q5_K",)

