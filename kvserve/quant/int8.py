"""int8 weights: torch's ``_weight_int8pack_mm`` (per-output-channel scales, bf16 activations)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve.quant.common import _KERNEL_DTYPE


# _weight_int8pack_mm reads the inputs in steps of 16 (it crashed on a 24-wide layer): other
# widths are padded with zero weights, and their inputs with zeros.
INT8_K_STEP = 16


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 act_dtype: torch.dtype = _KERNEL_DTYPE) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        w = nn.functional.pad(weight.float(), (0, -self.in_features % INT8_K_STEP))
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(act_dtype))
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.scales.dtype)
        if self.weight.shape[1] != self.in_features:  # (a padded layer only: no copy on the common path)
            x2 = nn.functional.pad(x2, (0, self.weight.shape[1] - self.in_features))
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
