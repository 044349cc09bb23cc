"""GGUF Q6_K weights in their own bits (6.5625 per weight), where the AVX512 (VNNI) kernel reads
them; other CPUs hold Q6_K as Q8Linear's 8-bit codes and fp32 sub-scales (10 bits a weight)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvserve import ops
from kvserve.quant.common import _block_quantized_forward, _fp32_bias, read_only_parts
from kvserve.quant.decode_format import DecodeFormatLinear
from kvserve.quant.nibbles import NIBBLE_TILE_ROWS, untile_nibbles

Q6_K_GROUP_BYTES = 256 + 128 + 32  # csrc/quant_linear.cpp Q6KTiles
Q6_K_SUPER_BYTES = 8 * Q6_K_GROUP_BYTES + 32


class Q6KLinear(DecodeFormatLinear):
    """``w = d * sc * (v - 32)`` per 16 inputs, ``v`` in 0..63, as Q6_K stores it: ``packed``
    ``[ceil(N / 16), K / 256, 3360]`` (block_repack.cpp's gguf_q6_k_tiles: per tile of 16 rows
    and super-block, 8 groups of 32 inputs as the nibble tiles' low 4 bits, two sets of 8 masks
    for the fifth and sixth bits, the int8 sub-scales, then the rows' fp16 d). The kernel takes
    each half-group's exact integer dot product against the split int16 activations (as the
    4-bit tiles) and its sub-scale ``d * sc`` (fp32, exact)."""

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("packed", packed)
        self.register_buffer("bias", _fp32_bias(bias))

    @staticmethod
    def kernel_reads_tiles() -> bool:
        return ops.nibble_kernel_isa() == "avx512"

    @classmethod
    def from_gguf_raw(cls, data: np.ndarray, type_name: str, shape: tuple[int, ...],
                      bias: Optional[torch.Tensor]) -> Optional["Q6KLinear"]:
        """The layer from a Q6_K tensor's bytes; None where no kernel reads the tiles (the caller
        then takes Q8Linear)."""
        ext = ops.load_extension()
        if ext is None or type_name != "Q6_K" or not cls.kernel_reads_tiles():
            return None
        packed = ext.gguf_q6_k_tiles(read_only_parts(data), shape[-1])
        return cls(packed, shape[0], shape[-1], bias)

    def _values_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(v int32 ``[N, K]`` in 0..63, d * sc fp32 ``[N, K / 16]``)."""
        tiles, supers, _ = self.packed.shape
        rows = NIBBLE_TILE_ROWS
        groups = self.packed[:, :, :8 * Q6_K_GROUP_BYTES].reshape(tiles, supers * 8, Q6_K_GROUP_BYTES)
        nibbles_and_fifth = torch.cat([groups[..., :256], groups[..., 256:320]], dim=-1)  # Q5 tiles' bytes
        low5, _, _ = untile_nibbles(torch.cat([nibbles_and_fifth, torch.zeros(tiles, supers * 8, 32,
                                                                                dtype=torch.uint8)], dim=-1),
                                    self.out_features)
        sixth = torch.cat([torch.zeros_like(groups[..., :256]), groups[..., 320:384],
                           torch.zeros(tiles, supers * 8, 32, dtype=torch.uint8)], dim=-1)
        six, _, _ = untile_nibbles(sixth, self.out_features)  # (the sixth bits in the fifth's place)
        values = low5 + 2 * (six & 16)
        sc = groups[..., 384:416].contiguous().view(torch.int8).float().view(tiles, supers * 8, 2, rows)
        sc = sc.permute(0, 3, 1, 2).reshape(tiles * rows, supers * 16)[:self.out_features]
        d = self.packed[:, :, 8 * Q6_K_GROUP_BYTES:].contiguous().view(torch.float16).float()  # (tile, super, row)
        d = d.permute(0, 2, 1).reshape(tiles * rows, supers)[:self.out_features].repeat_interleave(16, dim=-1)
        return values, d * sc

    def dequantized(self) -> torch.Tensor:
        values, scales = self._values_and_scales()
        w = (values - 32).float().view(self.out_features, -1, 16) * scales[..., None]
        return w.view(self.out_features, -1)

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return _block_quantized_forward(
            self, x, lambda ext, rows: ext.tiled_nibble_linear(rows, self.packed, self.out_features, self.bias))
