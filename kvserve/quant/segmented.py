"""A fused projection whose parts a GGUF stores in different block formats."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve.quant.decode_format import DecodeFormatLinear


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

    def reads_int8_prompts(self) -> bool:
        return any(s.reads_int8_prompts() for s in self.segments)

    def use_int8_prompts(self) -> bool:
        """Each segment the int8 kernel reads takes the int8 prompt path; the others compute
        prompt rows as they compute generated ones (Q8_0's codes, say)."""
        self.int8_prompts = self.prefill is None and any([s.use_int8_prompts() for s in self.segments])
        return self.int8_prompts

    def forward_int8_prompts(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([s.forward_int8_prompts(x) if s.int8_prompts else s.forward_blocks(x)
                          for s in self.segments], dim=-1)
