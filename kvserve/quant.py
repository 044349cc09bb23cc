"""Weight formats for the linear layers: bf16, INT8 and INT4 weights under fp32 activations.

Decode at small batch reads every weight once per token: it is bound by memory, not compute.
Storing the weights in 16, 8 or 4 bits cuts the bytes read per token 2-8x against fp32, and
bf16 matmuls run at about twice the fp32 rate on CPUs with AVX512-BF16/AMX. The activations
(the residual stream, norms, rope, attention) stay in the model's dtype, fp32 by default:
rounding the residual stream to bf16 at every layer is what costs a bf16 model its accuracy
(top-1 agreement with fp32 drops from 99 % to 95 % on SmolLM2), not the bf16 weights.

The INT kernels are torch's own: ``_weight_int8pack_mm`` (per-output-channel scales) and
``_weight_int4pack_mm_for_cpu`` (groups along the input dimension, ``w = (q - 8) * s + z``),
both fed bf16 activations. GGUF Q4_1 blocks (32 weights, ``w = d * q + m``) fit the int4
format with no second rounding of the 4-bit values: ``s = d``, ``z = m + 8 d``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from kvserve.config import ConfigError

WEIGHT_FORMATS = ("bf16", "int8", "int4")
INT4_GROUP_SIZE = 32
# The low-precision LM head's top candidates are rescored with the fp32 weights so that
# greedy picks and top logprobs carry fp32 precision (bf16 logits have ~3 significant digits).
LM_HEAD_RESCORE_TOP_K = 16
_KERNEL_DTYPE = torch.bfloat16


class Bf16Linear(nn.Module):
    """bf16 weights under any activation dtype (the input is cast to bf16 for the matmul).

    On the CPU the weight is stored pre-packed in oneDNN's blocked layout, as inductor does
    for frozen CPU models: the same products bit for bit, without the per-call repacking
    that makes a plain ``F.linear`` reach only 15-25 GFLOP/s at one row and about 60 % of
    the packed speed at 32 rows (measured here on SmolLM2's shapes).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        w = weight.detach().to(_KERNEL_DTYPE)
        self.prepacked = w.device.type == "cpu" and torch.backends.mkldnn.is_available()
        if self.prepacked:
            w = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.register_buffer("weight", w)
        self.register_buffer("bias", None if bias is None else bias.detach().to(_KERNEL_DTYPE))
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 act_dtype: torch.dtype = _KERNEL_DTYPE) -> None:
        super().__init__()
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(act_dtype))
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


class Int4Linear(nn.Module):
    """``y = x @ W^T`` with ``W[n, k] = (q[n, k] - 8) * s[g, n] + z[g, n]``, ``g = k // group``.

    The kernel takes its scales and zeros in bf16. A zero rounded to bf16 errs the same way
    for all 32 weights of its group, so its error adds up coherently over the group instead of
    averaging out; the zero term ``sum_g z[g, n] * sum(x in group g)`` is therefore computed
    separately in fp32 (a matmul 1/group the size of the main one), and the kernel gets z = 0.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: Optional[torch.Tensor], act_dtype: torch.dtype = _KERNEL_DTYPE,
                 group_size: int = INT4_GROUP_SIZE) -> None:
        """``q``: int32 [N, K] in 0..15; ``scales``, ``zeros``: [N, K // group_size]."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1))
        sz = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1)  # [K/g, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(act_dtype).contiguous())
        self.register_buffer("zeros", zeros.t().float().contiguous())  # [K/g, N]
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   act_dtype: torch.dtype = _KERNEL_DTYPE,
                   group_size: int = INT4_GROUP_SIZE) -> "Int4Linear":
        """Asymmetric min/max quantization of each group of ``group_size`` input weights."""
        n, k = weight.shape
        w = weight.float().view(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).view(n, k)
        return cls(q.to(torch.int32), scales, lo + 8.0 * scales, bias, act_dtype, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.to(self.scales_and_zeros.dtype), self.packed, self.group_size, self.scales_and_zeros)
        group_sums = x2.float().view(x2.shape[0], -1, self.group_size).sum(-1)
        y = torch.addmm(y.float(), group_sums, self.zeros) if self.bias is None else \
            torch.addmm(y.float() + self.bias, group_sums, self.zeros)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def unpack_q4_1(data: np.ndarray, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows -> (q int32 [N, K] in 0..15, d [N, K/32], m [N, K/32]) as float32.

    A block is ``half d, half m, uint8 qs[16]``: weight j is ``qs[j] & 15``, weight j + 16
    is ``qs[j] >> 4``."""
    n, k = shape[0], shape[-1]
    blocks = np.ascontiguousarray(data).reshape(n, k // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


class RescoredLMHead(nn.Module):
    """A low-precision LM head whose top candidates are recomputed with the fp32 weights.

    The cheap head ranks the whole vocabulary; the ``top_k`` best of each row get exact fp32
    logits (a [rows, top_k, hidden] gather and one batched dot product), so argmax and the top
    logprobs match an fp32 head unless the true best token fell outside the top k.
    """

    def __init__(self, fast: nn.Module, exact_weight: torch.Tensor, top_k: int = LM_HEAD_RESCORE_TOP_K) -> None:
        super().__init__()
        self.fast = fast
        self.exact_weight = exact_weight  # shared with the (fp32) embedding table when tied
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fast(x).float()
        if logits.shape[0] == 0:
            return logits
        idx = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).indices  # [S, k]
        rows = self.exact_weight.index_select(0, idx.reshape(-1)).view(*idx.shape, -1)
        exact = torch.bmm(rows.float(), x.float().unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, idx, exact)


def _q4_1_linear(raw_parts: list, bias: Optional[torch.Tensor]) -> Int4Linear:
    qs, ds, ms = zip(*(unpack_q4_1(p.data, p.shape) for p in raw_parts))
    d, m = torch.cat(ds), torch.cat(ms)
    return Int4Linear(torch.cat(qs), d, m + 8.0 * d, bias, _KERNEL_DTYPE, 32)


def convert_linear_layers(model: nn.Module, weight_format: str,
                          raw_weights: Optional[dict] = None) -> dict[str, int]:
    """Swap the decoder's linear layers and the LM head for ``weight_format`` ones.

    ``raw_weights`` (HF name -> GGUF QuantizedTensor) lets int4 reuse Q4_1 blocks exactly;
    other GGUF matrices stay bf16 in int4 mode. Float checkpoints are quantized from their
    values (int4: asymmetric min/max per group of 32). int8 is symmetric per output channel.
    The LM head is bf16 with fp32 rescoring of its top candidates. Returns how many layers
    got each format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight format {weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    from gguf import GGMLQuantizationType

    packed = getattr(model, "packed_modules", {})
    raw_weights = raw_weights or {}
    counts: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        if module.weight.device.type != "cpu" and weight_format != "bf16":
            raise ConfigError("int8/int4 weights use CPU kernels; use --device cpu")
        leaf = name.rsplit(".", 1)[-1]
        raw = [raw_weights.get(f"{name.rsplit('.', 1)[0]}.{part}.weight")
               for part in packed.get(leaf, (leaf,))]
        if weight_format == "bf16":
            new, kind = Bf16Linear(module.weight, module.bias), "bf16"
        elif weight_format == "int4" and all(r is not None and r.quant_type == GGMLQuantizationType.Q4_1
                                             for r in raw):
            new, kind = _q4_1_linear(raw, module.bias), "int4 (Q4_1 blocks reused)"
        elif (weight_format == "int4" and module.in_features % INT4_GROUP_SIZE == 0
              and all(r is None for r in raw)):
            # Float checkpoints (safetensors, test models): quantize afresh.
            new, kind = Int4Linear.from_float(module.weight, module.bias), "int4"
        elif weight_format == "int4":
            # A GGUF matrix in another type (Gemma's Q5_0/Q6_K/Q8_0, and Q4_K whose 6-bit
            # sub-scales would be rounded again): requantizing it to 4 bits measured 91 % top-1
            # agreement on Gemma 3, so it stays at bf16.
            new, kind = Bf16Linear(module.weight, module.bias), "bf16 (not Q4_1 in the file)"
        else:
            new, kind = Int8Linear(module.weight, module.bias), "int8"
        counts[kind] = counts.get(kind, 0) + 1
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, new)
    exact = model.lm_head.weight
    # bf16 in every format: the packed bf16 matmul reads the head faster at one row than
    # torch's int8 kernel does (0.9-1.5 ms against 2.0 ms for SmolLM2's 28 M weights).
    model.lm_head = RescoredLMHead(Bf16Linear(exact, None), exact)
    counts["lm_head bf16 + fp32 rescoring"] = 1
    return counts
