"""What the weight formats share: the batch-invariance switch, the load-time packers' call,
the bias and forward helpers around kvserve's kernels, buffer sizes."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from kvserve import ops

INT4_GROUP_SIZE = 32
_KERNEL_DTYPE = torch.bfloat16


def batch_invariant_linears() -> bool:
    """kvserve's batch-invariant kernels for bf16 and fp32 weights (the default), or, with
    ``KernelConfig(batch_invariant=False)`` in force, the BLAS paths used before (oneDNN, MKL):
    an explicit opt-out of determinism for machines where those are faster (AMX prefill)."""
    return ops.batch_invariant()


def _packed_by_kernel(kernel: str, weight: torch.Tensor) -> Optional[Any]:
    """The extension's load-time packer ``kernel`` (pack_bf16_weight, q8_0_quantize,
    q4_screen_pack) applied to a CPU ``weight``: one pass, the values of its plain-torch
    reference; None where the extension is off or the weight is elsewhere (the reference then)."""
    ext = ops.cpu_extension()
    if ext is None or weight.device.type != "cpu":
        return None
    return getattr(ext, kernel)(weight.detach().float().contiguous())


def _fp32_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.detach().float().contiguous()


def _block_quantized_forward(layer: nn.Module, x: torch.Tensor, kernel) -> torch.Tensor:
    """``layer(x)`` for kvserve's kernels (Int4Linear, Q8Linear, Bf16Linear, Fp32Linear): fp32 rows through the kernel
    (``kernel(extension, rows)``), or ``layer.forward_reference`` without the extension."""
    rows = x.reshape(-1, layer.in_features).float().contiguous()
    ext = ops.cpu_extension()
    y = kernel(ext, rows) if ext is not None and rows.device.type == "cpu" else layer.forward_reference(rows)
    return y.view(*x.shape[:-1], layer.out_features).to(x.dtype)


def _block_quantized_forward_into(layer: nn.Module, x: torch.Tensor, buffer: Callable[[int], torch.Tensor],
                                  on_kernel: bool, kernel) -> Optional[torch.Tensor]:
    """``layer(x)`` into ``buffer(rows)`` through ``kernel(extension, rows, out)`` when the layer
    runs on kvserve's kernels (``on_kernel``) and ``x`` is fp32 on the CPU; else None."""
    ext = ops.cpu_extension()
    if not on_kernel or ext is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    rows = x.reshape(-1, layer.in_features).contiguous()
    out = buffer(rows.shape[0])
    kernel(ext, rows, out)
    return out


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def read_only_parts(data: Union[np.ndarray, Sequence[np.ndarray]]) -> list[torch.Tensor]:
    """A GGUF matrix's bytes for the native repacks (block_repack.cpp), viewed in place: one
    array, or its row-stacked parts (a fused projection's q, k and v as the file stores them)."""
    return [read_only_tensor(part) for part in (data if isinstance(data, (list, tuple)) else [data])]


def read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array that may be read-only (a mapped file's bytes), for kernels
    that only read it: torch warns that writing it would be undefined; nothing here writes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))
