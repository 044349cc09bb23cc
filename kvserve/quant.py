"""Weight formats for the linear layers: bf16, INT8 and INT4 weights under fp32 activations.

Decode at small batch reads every weight once per token: it is bound by memory, not compute.
Storing the weights in 16, 8 or 4 bits cuts the bytes read per token 2-8x against fp32, and
bf16 matmuls run at about twice the fp32 rate on CPUs with AVX512-BF16/AMX. The activations
(the residual stream, norms, rope, attention) stay in the model's dtype, fp32 by default:
rounding the residual stream to bf16 at every layer is what costs a bf16 model its accuracy
(top-1 agreement with fp32 drops from 99 % to 95 % on SmolLM2), not the bf16 weights.

int8 uses torch's ``_weight_int8pack_mm`` (per-output-channel scales, bf16 activations).
int4 is GGUF's Q4_1 (groups of 32, ``w = d * q + m``), read as stored by kvserve's own kernel
(kvserve/csrc/quant_linear.cpp): SmolLM2's file is Q4_1, so its 4-bit values and fp16 scales
are used exactly as llama.cpp uses them. In int4 mode the LM head is Q8_0 (as in that file).
The block-quantized weights live in one huge-page buffer in the order a step reads them.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np
import torch
from torch import nn

from kvserve import ops
from kvserve.config import ConfigError
from kvserve.token_roles import current_token_roles

logger = logging.getLogger(__name__)

WEIGHT_FORMATS = ("bf16", "int8", "int4")
INT4_GROUP_SIZE = 32
# The low-precision LM head's top candidates are rescored with the fp32 weights so that
# greedy picks and top logprobs carry fp32 precision (bf16 logits have ~3 significant digits).
LM_HEAD_RESCORE_TOP_K = 16
_KERNEL_DTYPE = torch.bfloat16


def batch_invariant_linears() -> bool:
    """kvserve's batch-invariant kernels for bf16 and fp32 weights (the default), or, with
    ``KVSERVE_BATCH_INVARIANT=0``, the BLAS paths used before (oneDNN, MKL): an explicit
    opt-out of determinism for machines where those are faster (AMX prefill)."""
    return os.environ.get("KVSERVE_BATCH_INVARIANT", "1") != "0"


BF16_PANEL = 32  # output columns per packed panel of kvserve's bf16 kernel (csrc/dense_linear.cpp)


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the bf16 bits (int16) of ``[Np / 32, Kp / 2, 32, 2]``: panels of 32 output
    columns, then pairs of K (N rounded up to 32, K to 2, with zeros). One 512-bit load of
    a panel is 16 columns x 2 k, what one vdpbf16ps multiplies with a broadcast k pair."""
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
        self.prepacked = cpu and not self.packed and torch.backends.mkldnn.is_available()
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

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The packed kernel's sums in plain torch: bf16-rounded activations times the bf16
        weights, in fp32 (another summation order: equal to rounding, not bit for bit)."""
        if self._unpacked is None:
            self._unpacked = unpack_bf16_weight(self.weight, self.out_features, self.in_features).float()
        y = x.float().to(torch.bfloat16).float() @ self._unpacked.T
        return y if self.bias is None else y + self.bias


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
    """GGUF Q4_1 weights: per group of 32 input weights ``w = d * q + m``, ``q`` in 0..15, ``d``
    and ``m`` fp16 (20 bytes per 32 weights), kept in the file's byte layout.

    ``y = sum_g d_g * (q_g . x_g) + m_g * sum(x_g)``: the fused kernel (kvserve/csrc/quant_linear.cpp)
    streams the blocks once for all rows of the call, with bf16 products of the 4-bit values
    (exact in bf16) and the activations rounded to bf16, as every bf16 matmul does, and fp32
    group sums. Without the extension the same sums run in plain torch on weights expanded
    once (slow; for machines without a compiler).

    Buffers: ``qs`` uint8 ``[N, Kp / 2]`` (``Kp`` = K rounded up to 64 with zero groups; per
    group GGUF's 16 bytes: weight j in the low nibble of byte j, j + 16 in its high nibble);
    ``dm`` the fp16 bits (int16) of ``[N, Kp / 64, 4]`` = (d, d', m, m') of a chunk's two groups.

    Prefill weights (``add_prefill_copy``): the 4-bit kernel suits decode, whose few rows per
    step are bound by the bytes read, not prefill, where hundreds of rows make the step
    compute-bound and unpacking nibbles costs more than the bytes it saves (issue #17:
    SmolLM2's 256-token TTFT was 481 ms through this kernel, 204 ms with bf16 weights).
    ``prefill`` is then a ``Bf16Linear`` holding ``bf16(d * q + m)`` (3.2 times the bytes of
    the blocks), and the rows of a step's prompt tokens go through it, the others through
    the blocks (kvserve/token_roles.py: by the token's role, never by the batch, so results
    stay deterministic).
    """

    def __init__(self, qs: torch.Tensor, dm: torch.Tensor, in_features: int, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.out_features, self.in_features = qs.shape[0], in_features
        self.register_buffer("qs", qs.contiguous())
        self.register_buffer("dm", dm.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._expanded: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.prefill: Optional[Bf16Linear] = None

    def dequantized(self) -> torch.Tensor:
        """The weights ``d * q + m`` as fp32 ``[N, K]`` (computed afresh: not kept)."""
        n, kp = self.qs.shape[0], self.qs.shape[1] * 2
        groups = self.qs.view(n, kp // 32, 16)
        q = torch.cat([groups & 15, groups >> 4], dim=-1).float()  # weights 0-15, then 16-31
        dm = self.dm.view(torch.float16).float().view(n, kp // 64, 2, 2)
        d, m = dm[:, :, 0].reshape(n, kp // 32, 1), dm[:, :, 1].reshape(n, kp // 32, 1)
        return (q * d + m).view(n, kp)[:, :self.in_features]

    def add_prefill_copy(self) -> int:
        """Give the layer its bf16 prefill weights (see the class); their bytes."""
        self.prefill = Bf16Linear(self.dequantized(), self.bias)
        return self.prefill.weight.numel() * self.prefill.weight.element_size()

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: Optional[torch.Tensor]) -> "Int4Linear":
        """``q``: [N, K] in 0..15; ``d``, ``m``: [N, K / 32] (rounded to fp16)."""
        n, k = q.shape
        kp = -(-k // 64) * 64
        padded = torch.zeros(n, kp, dtype=torch.int32)
        padded[:, :k] = q.to(torch.int32)
        halves = padded.view(n, kp // 32, 2, 16)
        qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).reshape(n, kp // 2)
        scales = torch.zeros(2, n, kp // 32)
        scales[0, :, :k // 32], scales[1, :, :k // 32] = d, m
        dm = scales.view(2, n, kp // 64, 2).permute(1, 2, 0, 3).reshape(n, kp // 64, 4)
        return cls(qs, dm.to(torch.float16).view(torch.int16), k, bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> "Int4Linear":
        """Asymmetric min/max quantization of each group of 32 input weights (as Q4_1)."""
        n, k = weight.shape
        w = weight.detach().float().view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        d = ((hi - lo) / 15.0).clamp(min=1e-6).half().float()
        m = lo.half().float()
        q = torch.round((w - m[..., None]) / d[..., None]).clamp(0, 15).view(n, k)
        return cls.from_blocks(q, d, m, bias)

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``d * q`` fp32 [N, Kp], ``m`` fp32 [N, Kp / 32]): the weights for plain torch."""
        if self._expanded is None:
            n, kp = self.qs.shape[0], self.qs.shape[1] * 2
            groups = self.qs.view(n, kp // 32, 16)
            q = torch.cat([groups & 15, groups >> 4], dim=-1)  # weights 0-15, then 16-31
            dm = self.dm.view(torch.float16).float().view(n, kp // 64, 2, 2)
            d, m = dm[:, :, 0].reshape(n, kp // 32), dm[:, :, 1].reshape(n, kp // 32)
            self._expanded = ((q.float() * d[..., None]).view(n, kp), m)
        return self._expanded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, features]: the step's prompt rows through the prefill weights when the
        layer has them and the step's roles are installed, every other row through Q4_1."""
        roles = None if self.prefill is None else current_token_roles()
        if roles is None:
            return self.forward_q4(x)
        return roles.apply(x, self.prefill, self.forward_q4)

    def forward_q4(self, x: torch.Tensor) -> torch.Tensor:
        """Every row through the Q4_1 blocks."""
        return _block_quantized_forward(self, x, lambda ext, rows: ext.q4_linear(rows, self.qs, self.dm, self.bias))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's sums in plain torch: bf16-rounded activations times ``d * q``, plus
        each group's minimum times the fp32 sum of its activations."""
        dq, m = self.expanded()
        k, kp = self.in_features, dq.shape[1]
        xp = torch.nn.functional.pad(x.float(), (0, kp - k))
        y = xp.to(torch.bfloat16).float() @ dq.T + xp.view(x.shape[0], -1, INT4_GROUP_SIZE).sum(-1) @ m.T
        return y if self.bias is None else y + self.bias


class Q8Linear(nn.Module):
    """GGUF Q8_0 weights: per group of 32 input weights ``w = d * q``, ``q`` in -127..127, ``d``
    fp16, with fp32 activations; the fused kernel streams the 8-bit blocks (int4 mode's LM
    head, as llama.cpp stores SmolLM2's). ``qs`` int8 [N, K]; ``d`` fp16 bits (int16) [N, K / 32]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        n, k = weight.shape
        if k % INT4_GROUP_SIZE:
            raise ConfigError(f"Q8_0 needs in_features divisible by {INT4_GROUP_SIZE}, got {k}")
        w = weight.detach().float().view(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        d = (w.abs().amax(dim=-1) / 127.0).half()
        # Requantizing a dequantized Q8_0 tensor this way gives back its blocks exactly.
        q = torch.round(w / d.float().clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qs", q.view(n, k).contiguous())
        self.register_buffer("d", d.view(torch.int16).contiguous())
        self.out_features, self.in_features = n, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _block_quantized_forward(self, x, lambda ext, rows: ext.q8_linear(rows, self.qs, self.d, None))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (d * q)^T`` in plain torch (the weights expanded on every call)."""
        groups = self.qs.float().view(self.out_features, -1, INT4_GROUP_SIZE)
        w = groups * self.d.view(torch.float16).float()[..., None]
        return x.float() @ w.view(self.out_features, self.in_features).T


def _block_quantized_forward(layer: nn.Module, x: torch.Tensor, kernel) -> torch.Tensor:
    """``layer(x)`` for kvserve's kernels (Int4Linear, Q8Linear, Bf16Linear, Fp32Linear): fp32 rows through the kernel
    (``kernel(extension, rows)``), or ``layer.forward_reference`` without the extension."""
    rows = x.reshape(-1, layer.in_features).float().contiguous()
    ext = ops.cpu_extension()
    y = kernel(ext, rows) if ext is not None and rows.device.type == "cpu" else layer.forward_reference(rows)
    return y.view(*x.shape[:-1], layer.out_features).to(x.dtype)


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
        idx = ops.top_k(logits, min(self.top_k, logits.shape[-1]))[1]  # [S, k]
        return logits.scatter_(1, idx, ops.gathered_rows_dot(x.float(), self.exact_weight, idx))


def _q4_1_linear(raw_parts: list, bias: Optional[torch.Tensor]) -> Int4Linear:
    qs, ds, ms = zip(*(unpack_q4_1(p.data, p.shape) for p in raw_parts))
    return Int4Linear.from_blocks(torch.cat(qs), torch.cat(ds), torch.cat(ms), bias)


def convert_linear_layers(model: nn.Module, weight_format: str,
                          raw_weights: Optional[dict] = None, prefill_copies: bool = True) -> dict[str, int]:
    """Swap the decoder's linear layers and the LM head for ``weight_format`` ones.

    ``prefill_copies``: int4 layers also get their bf16 prefill weights (``Int4Linear``), for
    the prompt tokens; off for a draft model, which runs every row through the 4-bit weights.

    ``raw_weights`` (HF name -> GGUF QuantizedTensor) lets int4 reuse Q4_1 blocks exactly;
    other GGUF matrices stay bf16 in int4 mode. Float checkpoints are quantized from their
    values (int4: asymmetric min/max per group of 32). int8 is symmetric per output channel.
    The LM head is Q8_0 in int4 mode and bf16 otherwise, with fp32 rescoring of its top
    candidates. Returns how many layers got each format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight format {weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    from gguf import GGMLQuantizationType

    packed = getattr(model, "packed_modules", {})
    raw_weights = raw_weights or {}
    counts: dict[str, int] = {}
    prefill_bytes = 0
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
        if isinstance(new, Int4Linear) and prefill_copies:
            prefill_bytes += new.add_prefill_copy()
        counts[kind] = counts.get(kind, 0) + 1
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, new)
    exact = model.lm_head.weight
    if weight_format == "int4" and exact.device.type == "cpu" and exact.shape[1] % INT4_GROUP_SIZE == 0:
        # Q8_0, llama.cpp's format for SmolLM2's head: half the bytes of bf16 (1.0 against
        # 2.2 ms per token for its 28 M weights).
        model.lm_head, kind = RescoredLMHead(Q8Linear(exact), exact), "lm_head Q8_0 + fp32 rescoring"
    else:
        # bf16 otherwise: the packed bf16 matmul reads the head faster at one row than
        # torch's int8 kernel does (0.9-1.5 ms against 2.0 ms for SmolLM2's 28 M weights).
        model.lm_head, kind = RescoredLMHead(Bf16Linear(exact, None), exact), "lm_head bf16 + fp32 rescoring"
    counts[kind] = 1
    if prefill_bytes:
        logger.info("int4: bf16 prefill copies of the Q4_1 layers for prompt tokens, %.1f MiB",
                    prefill_bytes / 2**20)
    _weights_to_huge_pages(model)
    return counts


def prefill_copy_bytes(model: nn.Module) -> int:
    """The bytes of the int4 layers' bf16 prefill weights (0: none)."""
    return sum(m.prefill.weight.numel() * m.prefill.weight.element_size()
               for m in model.modules() if isinstance(m, Int4Linear) and m.prefill is not None)


def has_prefill_copies(model: nn.Module) -> bool:
    """Whether some linear layer computes prompt rows in another format than generated ones."""
    return any(isinstance(m, Int4Linear) and m.prefill is not None for m in model.modules())


# The buffers each format streams per token, in the order a step reads them. (oneDNN's
# pre-packed bf16 weights are opaque tensors that cannot be placed.)
_STREAMED_BUFFERS = {Int4Linear: ("qs", "dm"), Q8Linear: ("qs", "d")}


def _weights_to_huge_pages(model: nn.Module) -> None:
    """Move the block-quantized weights, in module (= reading) order, into one huge-page
    buffer (see ops.copy_to_huge_pages)."""
    slots = [(module, name) for module in model.modules() for name in _STREAMED_BUFFERS.get(type(module), ())]
    copies = ops.copy_to_huge_pages([getattr(module, name) for module, name in slots])
    for (module, name), copy in zip(slots, copies):
        setattr(module, name, copy)
