"""Tensor parallelism (Megatron-style) for the decoder models, as a sharding plan.

Per rank: the query heads ``[r * q/T, (r+1) * q/T)`` and their KV heads (split across ranks
when there are at least T of them, else replicated: rank r holds head ``r * kv // T``; MLA:
the heads' rows of q_proj / q_b_proj / kv_b_proj, the latent replicated, models/mla.py), a
1/T slice of the MLP's intermediate dimension, and a 1/T slice of the vocabulary (padded to
a multiple of T). Column-parallel: q/k/v, gate/up (rows sliced, no communication).
Row-parallel: o_proj and down_proj (input columns sliced), each followed by one all-reduce;
their bias is kept on rank 0 only so the sum adds it once. Vocabulary-parallel: the
embedding looks up its own rows (zeros elsewhere) and all-reduces; the LM head computes its
shard's logits and all-gathers them. Norms are replicated.

The model is built from ``local_config`` (the per-rank head counts and widths) so the model
code itself is unchanged but for the two all-reduces; ``shard_weight`` slices each upstream
weight as the loader streams it, so no rank ever holds more than one full tensor at a time.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from kvserve.block_formats import QuantizedTensor
from kvserve.config import ConfigError, ModelConfig
from kvserve.distributed import ParallelGroup, stage_layers
from kvserve.kv_cache import KVCacheGroup, KVCacheSpec


def check_tp_shape(config: ModelConfig, tp_size: int) -> None:
    """Raise ConfigError unless the model's heads and widths split over ``tp_size`` ranks."""
    q, kv = config.num_attention_heads, config.num_key_value_heads
    if config.num_experts and config.moe_intermediate_size % tp_size:
        raise ConfigError(f"tensor_parallel_size {tp_size} does not divide the experts' intermediate size "
                          f"{config.moe_intermediate_size}")
    if q % tp_size:
        raise ConfigError(f"tensor_parallel_size {tp_size} does not divide the {q} attention heads")
    if kv % tp_size and tp_size % kv:
        raise ConfigError(f"tensor_parallel_size {tp_size} neither divides nor is a multiple of the "
                          f"{kv} KV heads")
    if config.intermediate_size % tp_size:
        raise ConfigError(f"tensor_parallel_size {tp_size} does not divide the intermediate size "
                          f"{config.intermediate_size}")


def local_kv_heads(config: ModelConfig, tp_size: int) -> int:
    return max(1, config.num_key_value_heads // tp_size)


def local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The per-rank shape: what one rank's modules and KV cache are built from."""
    if tp_size == 1:
        return config
    check_tp_shape(config, tp_size)
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // tp_size,
        num_key_value_heads=local_kv_heads(config, tp_size),
        intermediate_size=config.intermediate_size // tp_size,
        moe_intermediate_size=config.moe_intermediate_size // tp_size)


def rank_kv_spec(config: ModelConfig, tp_size: int, pp_size: int, block_size: int,
                 kv_dtype: Union[str, torch.dtype], groups: tuple[KVCacheGroup, ...]) -> KVCacheSpec:
    """The KV the largest rank holds, per block: its KV heads, in the model's ``groups``
    (``kv_cache_groups``) cut down to its pipeline stage's layers (``stage_kv_spec``). The
    engine sizes the block count on it, so every rank has the same blocks, and describes it."""
    stages = [stage_kv_spec(config, tp_size, stage_layers(config.num_hidden_layers, pp_size, stage),
                            block_size, kv_dtype, groups) for stage in range(pp_size)]
    return max(stages, key=lambda spec: spec.bytes_per_block)


def stage_kv_spec(config: ModelConfig, tp_size: int, layer_range: tuple[int, int], block_size: int,
                  kv_dtype: Union[str, torch.dtype], groups: tuple[KVCacheGroup, ...]) -> KVCacheSpec:
    """The KV one rank of ``config``'s model (the full model's config) holds: its KV heads,
    layers ``[start, end)`` of its stage, each in its group and slot as the stage's cut of the
    model's ``groups`` puts it, every block. (MLA: the whole latent on every rank, models/mla.py
    says why.)"""
    whole = KVCacheSpec.for_model(config, block_size, kv_dtype, groups=groups,
                                  num_kv_heads=local_kv_heads(config, tp_size))
    return whole.restrict(*layer_range)


@dataclasses.dataclass(frozen=True)
class TPShardPlan:
    config: ModelConfig  # the full model's
    rank: int
    size: int

    @property
    def vocab_shard(self) -> int:
        return -(-self.config.vocab_size // self.size)

    def _kv_head_range(self) -> tuple[int, int]:
        kv = self.config.num_key_value_heads
        if kv >= self.size:
            per = kv // self.size
            return self.rank * per, (self.rank + 1) * per
        head = self.rank * kv // self.size
        return head, head + 1

    def row_range(self, name: str) -> Optional[tuple[int, int]]:
        """Output rows (dim 0) this rank keeps of a column-parallel or vocabulary weight."""
        cfg, r, t = self.config, self.rank, self.size
        if ".q_proj." in name or ".q_b_proj." in name:  # (MLA: head_dim is nope + rope)
            per = cfg.num_attention_heads // t * cfg.head_dim
            return r * per, (r + 1) * per
        if ".kv_b_proj." in name:  # MLA: each head's key nope rows, then its value rows
            per = cfg.num_attention_heads // t * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            return r * per, (r + 1) * per
        if ".k_proj." in name or ".v_proj." in name:
            h0, h1 = self._kv_head_range()
            return h0 * cfg.head_dim, h1 * cfg.head_dim
        if ".gate_proj." in name or ".up_proj." in name:
            per = self._mlp_width(name) // t
            return r * per, (r + 1) * per
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return r * self.vocab_shard, min(cfg.vocab_size, (r + 1) * self.vocab_shard)
        return None

    def column_range(self, name: str) -> Optional[tuple[int, int]]:
        """Input columns (dim 1) this rank keeps of a row-parallel weight."""
        cfg, r, t = self.config, self.rank, self.size
        if ".o_proj.weight" in name:
            per = cfg.num_attention_heads // t * (cfg.v_head_dim if cfg.uses_mla else cfg.head_dim)
            return r * per, (r + 1) * per
        if ".down_proj.weight" in name:
            per = self._mlp_width(name) // t
            return r * per, (r + 1) * per
        return None

    def _mlp_width(self, name: str) -> int:
        """The intermediate width of the MLP holding weight ``name``: a routed expert's
        (``mlp.experts.<e>.``) or the dense MLP's. Experts are sharded like dense MLPs, each
        rank a 1/T slice of every expert's columns, rather than whole experts per rank: every
        rank then does 1/T of each active expert's work whatever the routing, where experts
        placed per rank would leave a rank idle when its experts are not chosen. The router
        is replicated (its weight ``mlp.gate.weight`` matches no rule), so every rank routes
        the same tokens to the same experts, and the block's output is all-reduced once.
        DeepSeek's shared experts (``mlp.shared_experts.``, one MLP ``n_shared_experts`` expert
        widths wide) are split the same way, inside the same all-reduce."""
        cfg = self.config
        if ".shared_experts." in name:
            return cfg.moe_intermediate_size * cfg.n_shared_experts
        return cfg.moe_intermediate_size if ".experts." in name else cfg.intermediate_size

    def fused_parts(self, name: str) -> Optional[list[tuple[str, int, int]]]:
        """For a checkpoint tensor that holds several projections in its rows (Phi-3's
        ``qkv_proj`` and ``gate_up_proj``): each part's upstream name as the unfused
        architectures spell it, and its rows ``[start, end)``; None for any other tensor.
        Each part is then sharded by its own rule and the rank's pieces stacked again, in
        the order the model's fused layer holds them (models/base.py's packed layout)."""
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        elif ".gate_up_proj." in name:
            sizes = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
        else:
            return None
        fused = ".qkv_proj." if ".qkv_proj." in name else ".gate_up_proj."
        parts, start = [], 0
        for part, size in sizes.items():
            parts.append((name.replace(fused, f".{part}."), start, start + size))
            start += size
        return parts

    def shard_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the upstream weight ``name`` (replicated ones unchanged)."""
        parts = self.fused_parts(name)
        if parts is not None:
            return torch.cat([self.shard_weight(part, tensor[a:b]) for part, a, b in parts])
        if name.endswith((".o_proj.bias", ".down_proj.bias")):
            # Row-parallel bias: added once, by rank 0, before the all-reduce sums the parts.
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        rows = self.row_range(name)
        if rows is not None:
            part = tensor[rows[0]:rows[1]]
            if name in ("model.embed_tokens.weight", "lm_head.weight") and part.shape[0] < self.vocab_shard:
                pad = torch.zeros(self.vocab_shard - part.shape[0], *part.shape[1:], dtype=part.dtype)
                part = torch.cat([part, pad])
            return part.contiguous()
        cols = self.column_range(name)
        if cols is not None:
            return tensor[:, cols[0]:cols[1]].contiguous()
        return tensor

    def shard_raw(self, name: str, raw):
        """A GGUF QuantizedTensor's part for this rank, cut on quantization-block boundaries;
        None when the shard boundary falls inside a block (the layer is then quantized from
        its float values)."""
        from gguf.constants import GGML_QUANT_SIZES

        parts = self.fused_parts(name)
        if parts is not None:
            pieces = [self.shard_raw(part, QuantizedTensor(raw.quant_type, raw.data[a:b], (b - a, *raw.shape[1:])))
                      for part, a, b in parts]
            data = np.ascontiguousarray(np.concatenate([piece.data for piece in pieces]))
            return QuantizedTensor(raw.quant_type, data, (sum(piece.shape[0] for piece in pieces), *raw.shape[1:]))
        rows = self.row_range(name)
        if rows is not None:
            return QuantizedTensor(raw.quant_type, raw.data[rows[0]:rows[1]],
                                   (rows[1] - rows[0], *raw.shape[1:]))
        cols = self.column_range(name)
        if cols is None:
            return raw
        block, type_size = GGML_QUANT_SIZES[raw.quant_type]
        if cols[0] % block or cols[1] % block:
            return None
        b0, b1 = cols[0] // block * type_size, cols[1] // block * type_size
        return QuantizedTensor(raw.quant_type, np.ascontiguousarray(raw.data[:, b0:b1]),
                               (raw.shape[0], cols[1] - cols[0]))


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows ``[r * shard, (r+1) * shard)`` of the table; a token outside them
    contributes zeros, and the all-reduce leaves every rank with every row (exactly: one
    addend is non-zero)."""

    def __init__(self, vocab_shard: int, hidden_size: int, tp: ParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_shard, hidden_size), requires_grad=False)
        self.vocab_start = tp.rank * vocab_shard
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
        return self.tp.all_reduce(rows)


def shard_model_in_place(model: nn.Module, plan: TPShardPlan, tp: ParallelGroup) -> None:
    """On a freshly built (meta) model of ``local_config``: swap in the vocabulary-parallel
    embedding and LM head and hand the attention and MLP modules their all-reduce."""
    cfg = plan.config
    model.model.embed_tokens = VocabParallelEmbedding(plan.vocab_shard, cfg.hidden_size, tp)
    model.lm_head = nn.Linear(cfg.hidden_size, plan.vocab_shard, bias=False)
    model.tp = tp
    model.vocab_size = cfg.vocab_size
    model.tie_weights()
    for layer in model.model.layers:
        layer.self_attn.tp = tp
        layer.mlp.tp = tp
