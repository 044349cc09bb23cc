"""Qwen3-MoE: Qwen3's attention (QK-norm) with a routed mixture of experts in place of the
MLP (except the layers in ``mlp_only_layers``, which keep a dense one).

Router: softmax over the experts' logits (in float32, as HF), the top ``num_experts_per_tok``
(ties broken by the lower expert index: models/routing.py), optionally renormalised
(``norm_topk_prob``). Experts run only on the tokens routed to them, grouped per expert
(models/moe.py, shared with DeepSeek).

The native fused decoder runs these layers too (``DecoderLayerSpec(mlp="moe",
routing="softmax_top_k")``; models/fused.py): the same routing kernel and, per active expert,
the same linear kernels on the same rows, so the same numbers as the modules below, which stay
the reference. Under tensor parallelism each rank holds a slice of every expert's columns
(models/tensor_parallel.py says why) and runs the modules.

Parameter names are HF's checkpoint names: ``mlp.gate.weight`` (the router) and
``mlp.experts.<e>.{gate,up,down}_proj.weight`` (gate and up fused per expert at load).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from kvserve.config import ConfigError, ModelConfig
from kvserve.distributed import ParallelGroup
from kvserve.models.gguf_layout import (
    EXPERT_STACK_NAMES, LLAMA_BLOCK_NAMES, QK_NORM_NAMES, ROUTER_NAMES, GGUFLayout, GGUFMetadata, check_expert_stacks,
    moe_layers,
)
from kvserve.models.layers import RMSNorm
from kvserve.models.llama import GatedMLP, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.models.moe import MoERouter, run_routed_experts
from kvserve.models.qwen3 import Qwen3Attention
from kvserve.models.routing import softmax_top_k
from kvserve.models.spec import DecoderLayerSpec
from kvserve.tracing import label

ARCHITECTURE = "qwen3_moe"


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` in the logits' dtype, expert ids ``[T, k]``): the softmax's top k,
    ties to the lower expert id, optionally renormalised to sum to 1."""
    weights, experts = softmax_top_k(logits, top_k, normalize)
    return weights.to(logits.dtype), experts


class SparseMoEBlock(nn.Module):
    # Tensor parallelism: every expert's slice of its intermediate columns on this rank (its
    # GatedMLP has no group of its own); the summed output is all-reduced once.
    tp: Optional[ParallelGroup] = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = MoERouter(config.hidden_size, config.num_experts)
        expert_config = dataclasses.replace(config, intermediate_size=config.moe_intermediate_size)
        self.experts = nn.ModuleList(GatedMLP(expert_config) for _ in range(config.num_experts))
        self.hidden_act = config.hidden_act  # (as GatedMLP's, for whoever reads the layer's MLP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with label("router"):
            weights, experts = route(self.gate(x), self.top_k, self.normalize)
        out = run_routed_experts(x, weights, experts, self.experts)
        return out if self.tp is None else self.tp.all_reduce(out)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return SparseMoEBlock(config) if config.is_moe_layer(layer_idx) else GatedMLP(config)


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen3MoeModel
    layer_spec = DecoderLayerSpec(norm_offset=RMSNorm.offset, qk_norm=True, mlp="moe", routing="softmax_top_k")

    @classmethod
    def adapt_hf_config(cls, hf_config: dict[str, Any], config: ModelConfig) -> None:
        config.attention_bias = bool(hf_config.get("attention_bias", False))
        # (transformers 5 writes num_local_experts; older configs num_experts)
        config.num_experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
        config.num_experts_per_tok = int(hf_config.get("num_experts_per_tok", 0))
        config.moe_intermediate_size = int(hf_config.get("moe_intermediate_size", 0))
        config.norm_topk_prob = bool(hf_config.get("norm_topk_prob", False))
        config.mlp_only_layers = [int(i) for i in hf_config.get("mlp_only_layers") or []]
        config.decoder_sparse_step = int(hf_config.get("decoder_sparse_step", 1) or 1)
        if config.num_experts < 1 or not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise ConfigError(f"qwen3_moe: {config.num_experts_per_tok} experts per token of {config.num_experts}")


def tiny_config() -> ModelConfig:
    """A random-weight test model on SmolLM2's vocabulary: 8 experts, top 2, renormalised;
    layer 1 of 3 dense (``mlp_only_layers``)."""
    return ModelConfig(
        architecture=ARCHITECTURE, vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu",
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], name="tiny-qwen3-moe",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1],
    )


def adapt_gguf_config(meta: GGUFMetadata, config: ModelConfig) -> None:
    """Qwen3-MoE from a GGUF file: the experts from the metadata; a layer without a router
    keeps a dense MLP (HF's ``mlp_only_layers``; llama.cpp's own files route every layer). The
    top-k weights are renormalised unless the file says otherwise: llama.cpp's qwen3moe graph
    always renormalises (transformers' GGUF loader defaults to the same)."""
    n_layers = config.num_hidden_layers
    config.num_experts = int(meta.get("expert_count", required=True))
    config.num_experts_per_tok = int(meta.get("expert_used_count", required=True))
    routed = moe_layers(meta, n_layers)
    width = meta.get("expert_feed_forward_length")
    if width is None and routed:
        width = meta.tensor_shape(f"blk.{routed[0]}.ffn_gate_exps.weight")[1]
    config.moe_intermediate_size = int(width or 0)
    config.norm_topk_prob = bool(meta.get("expert_weights_norm", True))
    config.mlp_only_layers = [i for i in range(n_layers) if i not in routed]
    config.decoder_sparse_step = 1
    if config.num_experts < 1 or not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ConfigError(f"{meta.path}: {config.num_experts_per_tok} experts per token of {config.num_experts}")
    check_expert_stacks(meta, config)


GGUF_LAYOUTS = (GGUFLayout("qwen3moe", ARCHITECTURE, {**LLAMA_BLOCK_NAMES, **QK_NORM_NAMES, **ROUTER_NAMES},
                           expert_names=EXPERT_STACK_NAMES, adapt=adapt_gguf_config),)
