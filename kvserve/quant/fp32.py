"""fp32 weights through kvserve's batch-invariant kernel."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.quant.common import _block_quantized_forward, batch_invariant_linears


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
