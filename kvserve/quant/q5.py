"""GGUF Q5_0 weights as stored."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvserve import block_formats
from kvserve.quant.common import INT4_GROUP_SIZE, _block_quantized_forward, _fp32_bias
from kvserve.quant.decode_format import DecodeFormatLinear
from kvserve.quant.nibbles import tile_nibbles, tiled_nibble_kernels, untile_nibbles


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
