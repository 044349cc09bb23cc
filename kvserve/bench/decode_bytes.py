"""The bytes one decode token reads at batch 1, counted from the loaded model, and how fast
an engine read them against the machine's measured read bandwidth.

A decode step at batch 1 multiplies one row by every weight matrix once and attends once over
the cached keys and values, so what it must read is:

- each linear layer's decode weights in the format they are held in (``quant.registry``:
  bf16 panels, int8 codes and scales, the 4/5/8-bit tiles with their scales, Q6_K's bits),
  counted from the tensors the layer holds; a block-quantized layer's prefill copy
  (``DecodeFormatLinear.prefill``) serves prompt rows only and is not counted;
- the LM head: at a greedy step its 4-bit screen (``Q4Screen``) plus the exact rows of the
  rescored candidates, else the low-precision head (``RescoredLMHead.fast``);
- the KV cache: every layer's keys and values of the positions it attends to (a sliding
  layer at most its window).

Left out as negligible (under 0.1 % of SmolLM2's bytes): norm weights, biases of layers
without a format, and the one embedding row a token reads.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from kvserve.kv_cache import KVCacheSpec
from kvserve.quant.lm_head import SCREEN_TOP_K, RescoredLMHead
from kvserve.quant.registry import format_of
from kvserve.quant.segmented import SegmentedLinear


def _own_tensor_bytes(module: nn.Module) -> int:
    """The bytes of the tensors ``module`` itself holds (not its children's: a prefill copy
    is a child). Counted by elements, never by storage: the streamed buffers are views into
    one shared huge-page arena (``quant.convert``), whose storage is the whole model's."""
    return sum(t.numel() * t.element_size()
               for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)] if t is not None)


def linear_decode_bytes(layer: nn.Module) -> int:
    """What a decode row reads of one linear layer: a segmented layer's parts, a
    block-quantized layer's blocks (not its prefill copy), any other format's own tensors."""
    if isinstance(layer, SegmentedLinear):
        return sum(linear_decode_bytes(segment) for segment in layer.segments)
    return _own_tensor_bytes(layer)


def _exact_row_bytes(head: RescoredLMHead) -> float:
    """One row of the head's exact weights (a rescored candidate): the row table's bytes
    (an embedding, Q8 blocks, or a GGUF tensor read in place) over its rows."""
    rows = head.exact_weight
    if isinstance(rows, torch.Tensor):  # the fp32 table itself
        tensors = [rows]
    elif getattr(rows, "raw", None) is not None:  # GGUFRows: the mapped tensor is no buffer
        tensors = [rows.raw]
    else:  # Q8Table
        tensors = [*rows.parameters(), *rows.buffers()]
    table = sum(t.numel() * t.element_size() for t in tensors)
    return table / max(1, head.fast.out_features)


def lm_head_decode_bytes(head: nn.Module, greedy: bool) -> float:
    """The head's bytes per token: screen + the top candidates' exact rows at a greedy step
    where a screen exists, else the low-precision head + its rescored rows."""
    if not isinstance(head, RescoredLMHead):
        return linear_decode_bytes(head)
    if greedy and head.screen is not None:
        return _own_tensor_bytes(head.screen) + SCREEN_TOP_K * _exact_row_bytes(head)
    return linear_decode_bytes(head.fast) + head.top_k * _exact_row_bytes(head)


@dataclass(frozen=True)
class KVReadSpec:
    """Per layer group: its layer count and window (None: full attention), and the bytes one
    token of one layer holds (K and V, scales included)."""

    groups: tuple[tuple[int, Optional[int]], ...]
    bytes_per_layer_token: int

    @classmethod
    def from_cache_spec(cls, spec: KVCacheSpec) -> "KVReadSpec":
        return cls(tuple((len(g.layers), g.window) for g in spec.groups), spec.bytes_per_layer_token)

    def bytes_at(self, context_len: float) -> float:
        """Keys and values read by one decode token that attends to ``context_len`` positions."""
        return self.bytes_per_layer_token * sum(
            layers * (context_len if window is None else min(context_len, window))
            for layers, window in self.groups)


@dataclass(frozen=True)
class DecodeBytes:
    """What one batch-1 decode token reads: linear weights by format, the LM head, the KV."""

    linear_bytes_by_format: dict[str, int]
    lm_head_bytes: float
    kv: KVReadSpec
    greedy: bool = True

    @property
    def weight_bytes(self) -> float:
        return sum(self.linear_bytes_by_format.values()) + self.lm_head_bytes

    def per_token(self, context_len: float) -> float:
        return self.weight_bytes + self.kv.bytes_at(context_len)

    def to_dict(self, context_len: Optional[float] = None) -> dict:
        d = {"weight_bytes": self.weight_bytes, "lm_head_bytes": self.lm_head_bytes,
             "linear_bytes_by_format": dict(self.linear_bytes_by_format), "greedy": self.greedy,
             "kv_bytes_per_layer_token": self.kv.bytes_per_layer_token,
             "kv_groups": [{"layers": n, "window": w} for n, w in self.kv.groups]}
        if context_len is not None:
            d.update(mean_context_len=context_len, kv_bytes=self.kv.bytes_at(context_len),
                     bytes_per_token=self.per_token(context_len))
        return d


def count_decode_bytes(model: nn.Module, kv_spec: KVCacheSpec, greedy: bool = True) -> DecodeBytes:
    """Walk ``model``: every module with a weight format is a linear layer (counted whole,
    children included where they are its parts); a ``RescoredLMHead`` is the head."""
    by_format: Counter[str] = Counter()
    head_bytes = 0.0

    def visit(module: nn.Module) -> None:
        nonlocal head_bytes
        if isinstance(module, RescoredLMHead):
            head_bytes += lm_head_decode_bytes(module, greedy)
            return
        fmt = format_of(module)
        if fmt is not None:
            by_format[fmt.name] += linear_decode_bytes(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return DecodeBytes(dict(by_format), head_bytes, KVReadSpec.from_cache_spec(kv_spec), greedy)


def mean_decode_context(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """The mean number of positions a decode token attends to: the first output token comes
    from the prompt's forward pass, the k-th after it (k = 1..n-1) attends to prompt + k."""
    contexts = [p + k for p, n in zip(prompt_lens, output_lens) for k in range(1, n)]
    return sum(contexts) / len(contexts) if contexts else 0.0


@dataclass(frozen=True)
class BandwidthUse:
    """Bytes per decode token over the time per token, against the machine's read bandwidth."""

    bytes_per_token: float
    tpot_s: float
    read_bandwidth_gbs: float

    @property
    def achieved_gbs(self) -> float:
        return self.bytes_per_token / self.tpot_s / 1e9

    @property
    def fraction(self) -> float:
        return self.achieved_gbs / self.read_bandwidth_gbs


def summary_bandwidth_use(summary: dict, read_bandwidth_gbs: Optional[float]) -> Optional[dict]:
    """A batch-1 run's summary (its ``decode_bytes`` at the run's mean context and its mean
    TPOT) against the read bandwidth: the ``decode_bandwidth`` entry of a W3 result."""
    counted = summary.get("decode_bytes")
    tpot_ms = (summary.get("tpot_ms") or {}).get("mean")
    if not counted or not tpot_ms or not read_bandwidth_gbs or "bytes_per_token" not in counted:
        return None
    use = BandwidthUse(counted["bytes_per_token"], tpot_ms / 1e3, read_bandwidth_gbs)
    return {"bytes_per_token": use.bytes_per_token, "weight_bytes": counted["weight_bytes"],
            "kv_bytes": counted["kv_bytes"], "tpot_ms": tpot_ms, "achieved_read_gbs": use.achieved_gbs,
            "read_bandwidth_gbs": read_bandwidth_gbs, "fraction_of_read_bandwidth": use.fraction}

