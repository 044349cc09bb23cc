"""bf16 weights under fp32 activations: kvserve's packed bf16 kernel, oneDNN's pre-packed
weights, or a plain ``F.linear``."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.quant.common import (_KERNEL_DTYPE, _block_quantized_forward, _block_quantized_forward_into,
                                  _packed_by_kernel, batch_invariant_linears)

BF16_PANEL = 32  # output columns per packed panel of kvserve's bf16 kernel (csrc/dense_linear.cpp)


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


def widened_bf16_kernel() -> bool:
    """Whether Bf16Linear runs kvserve's kernel on its widened AVX512 route here (bf16 weights
    widened to fp32 for 16-lane FMAs: Intel's cores), rather than vdpbf16ps, AVX2, oneDNN."""
    ext = ops.load_extension()
    return ext is not None and batch_invariant_linears() and ext.bf16_kernel_route() == "widened512"
