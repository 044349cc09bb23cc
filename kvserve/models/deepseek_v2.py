"""DeepSeek V2 (and V2-Lite): multi-head latent attention (models/mla.py) on the latent KV
cache, and a mixture of experts with shared experts in every layer from
``first_k_dense_replace`` on (the first layers keep a dense MLP).

MoE: the router's logits in float32 (HF), softmax scores, top-k by ``topk_method``: "greedy",
or "group_limited_greedy" (only the ``topk_group`` of ``n_group`` expert groups with the best
single expert compete), ties to the lower index (models/routing.py); the weights times
``routed_scaling_factor``. The routed experts run on their tokens only (models/moe.py, shared
with Qwen3-MoE); the shared experts (one MLP ``n_shared_experts`` times the expert width) run
on every token and are added after them (HF's order).

Parameter names are HF's checkpoint names: ``self_attn.{q_proj | q_a_proj, q_a_layernorm,
q_b_proj}``, ``self_attn.kv_a_proj_with_mqa``, ``self_attn.kv_a_layernorm``,
``self_attn.kv_b_proj``, ``self_attn.o_proj``; ``mlp.gate.weight`` (the router),
``mlp.experts.<e>.{gate,up,down}_proj.weight`` and ``mlp.shared_experts.{gate,up,down}_proj``
(gate and up fused at load). Neither the native fused decoder (``DecoderLayerSpec``:
attention "mla", mlp "moe") nor the C++ attention kernel runs these layers: the model runs
layer by layer in torch.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from kvserve.config import ConfigError, ModelConfig
from kvserve.distributed import ParallelGroup
from kvserve.models.gguf_layout import (
    EXPERT_STACK_NAMES, ROUTER_NAMES, GGUFLayout, GGUFMetadata, check_expert_stacks,
)
from kvserve.models.layers import RMSNorm
from kvserve.models.llama import GatedMLP, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.models.mla import MultiHeadLatentAttention
from kvserve.models.moe import MoERouter, run_routed_experts
from kvserve.models.routing import check_deepseek_routing, deepseek_route
from kvserve.models.spec import DecoderLayerSpec
from kvserve.tracing import label

ARCHITECTURE = "deepseek_v2"


class DeepseekRouter(MoERouter):
    """The router's float32 logits, and V3's ``e_score_correction_bias`` (the load-balancing
    bias noaux_tc adds to the scores it chooses by, never to the weights)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.num_experts, float32_logits=True)
        self.e_score_correction_bias: Optional[nn.Parameter] = None
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)


class DeepseekMoE(nn.Module):
    # Tensor parallelism: a 1/T slice of every routed expert's and of the shared experts'
    # columns (models/tensor_parallel.py); their sum is all-reduced once.
    tp: Optional[ParallelGroup] = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = DeepseekRouter(config)
        expert_config = dataclasses.replace(config, intermediate_size=config.moe_intermediate_size)
        self.experts = nn.ModuleList(GatedMLP(expert_config) for _ in range(config.num_experts))
        self.shared_experts: Optional[GatedMLP] = None
        if config.n_shared_experts:
            self.shared_experts = GatedMLP(dataclasses.replace(
                config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts))
        self.hidden_act = config.hidden_act  # (as GatedMLP's, for whoever reads the layer's MLP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with label("router"):
            weights, experts = deepseek_route(self.gate(x), self.config, self.gate.e_score_correction_bias)
        out = run_routed_experts(x, weights, experts, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.tp is None else self.tp.all_reduce(out)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_class = MultiHeadLatentAttention

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return DeepseekMoE(config) if config.is_moe_layer(layer_idx) else GatedMLP(config)


class DeepseekV2Model(LlamaModel):
    layer_class = DeepseekV2DecoderLayer

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        return config.qk_rope_head_dim


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_class = DeepseekV2Model
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}
    layer_spec = DecoderLayerSpec(norm_offset=RMSNorm.offset, mlp="moe", attention="mla")

    @classmethod
    def adapt_hf_config(cls, hf_config: dict[str, Any], config: ModelConfig) -> None:
        adapt_mla_config(hf_config, config)
        adapt_moe_config(hf_config, config)
        config.topk_method = hf_config.get("topk_method") or "greedy"
        config.scoring_func = "softmax"
        config.rope_interleave = True  # (V2's rope always rotates adjacent pairs)
        check_deepseek_config(config)


def adapt_mla_config(hf_config: dict[str, Any], config: ModelConfig) -> None:
    """MLA's shapes (V2 and V3 alike). ``head_dim`` becomes the query/key head width (nope +
    rope, what generic code counts per head; HF's config calls that ``qk_head_dim`` and sets its
    ``head_dim`` to the rope part), and every head is its own "KV head" (the latent cache has
    none; tensor parallelism splits heads as MHA's)."""
    quant = (hf_config.get("quantization_config") or {}).get("quant_method")
    if quant:  # (V3's own release: fp8 blocks with weight_scale_inv tensors)
        raise ConfigError(f"{config.architecture}: {quant}-quantized checkpoints are not supported "
                          f"(load a bf16 or fp32 copy)")
    config.q_lora_rank = int(hf_config["q_lora_rank"]) if hf_config.get("q_lora_rank") else None
    config.kv_lora_rank = int(hf_config["kv_lora_rank"])
    config.qk_nope_head_dim = int(hf_config["qk_nope_head_dim"])
    config.qk_rope_head_dim = int(hf_config["qk_rope_head_dim"])
    config.v_head_dim = int(hf_config["v_head_dim"])
    config.head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    config.num_key_value_heads = config.num_attention_heads
    config.attention_bias = bool(hf_config.get("attention_bias", False))
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("rope_type") == "yarn":
        if "original_max_position_embeddings" not in scaling:
            raise ConfigError(f"{config.architecture}: yarn rope scaling without original_max_position_embeddings")
        if not scaling.get("factor"):  # (HF: the ratio of the two context lengths)
            scaling["factor"] = config.max_position_embeddings / scaling["original_max_position_embeddings"]


def adapt_moe_config(hf_config: dict[str, Any], config: ModelConfig) -> None:
    """DeepSeek's experts (V2 and V3): routed and shared, dense before ``first_k_dense_replace``."""
    freq = int(hf_config.get("moe_layer_freq", 1) or 1)
    if freq != 1:  # (HF's DeepseekV2/V3 ignore it; DeepSeek's own code skips layers by it)
        raise ConfigError(f"{config.architecture}: moe_layer_freq {freq} is not supported (1 only)")
    config.num_experts = int(hf_config.get("n_routed_experts") or 0)
    config.num_experts_per_tok = int(hf_config.get("num_experts_per_tok") or 0)
    config.moe_intermediate_size = int(hf_config.get("moe_intermediate_size") or 0)
    config.n_shared_experts = int(hf_config.get("n_shared_experts") or 0)
    config.routed_scaling_factor = float(hf_config.get("routed_scaling_factor", 1.0))
    config.norm_topk_prob = bool(hf_config.get("norm_topk_prob", False))
    config.n_group = int(hf_config.get("n_group") or 1)
    config.topk_group = int(hf_config.get("topk_group") or 1)
    first_dense = min(int(hf_config.get("first_k_dense_replace") or 0), config.num_hidden_layers)
    config.mlp_only_layers = list(range(first_dense))


def check_deepseek_config(config: ModelConfig) -> None:
    """Raise ConfigError for shapes kvserve's MLA and routing cannot run."""
    arch = config.architecture
    if config.qk_rope_head_dim < 2 or config.qk_rope_head_dim % 2:
        raise ConfigError(f"{arch}: qk_rope_head_dim must be even, got {config.qk_rope_head_dim}")
    if min(config.kv_lora_rank, config.qk_nope_head_dim, config.v_head_dim) < 1:
        raise ConfigError(f"{arch}: kv_lora_rank, qk_nope_head_dim and v_head_dim must be positive")
    if any(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        check_deepseek_routing(config)


def tiny_config() -> ModelConfig:
    """A random-weight DeepSeek-V2-Lite-shaped test model on SmolLM2's vocabulary: no query
    bottleneck (``q_lora_rank`` None), a 32-wide latent with a 16-dim rope key (both powers of
    two, so the int8 cache can take them), 8 experts in 4 groups of which 2 compete
    (group_limited_greedy), top 2, one shared expert, the first of 3 layers dense."""
    return ModelConfig(
        architecture=ARCHITECTURE, vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2], name="tiny-deepseek-v2",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    )


# llama.cpp's expert gating functions (gguf's ExpertGatingFuncType)
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2


def adapt_gguf_config(meta: GGUFMetadata, config: ModelConfig) -> None:
    """DeepSeek V2/V3 from a GGUF file (general.architecture ``deepseek2`` for both).

    MLA: newer files describe the latent cache in ``key_length`` / ``value_length`` and the
    heads in the ``*_mla`` keys; older ones the heads in ``key_length`` / ``value_length``.
    Routing: the file names its gating function; a softmax router is V2's ("group_limited_greedy"
    where the file names expert groups, else "greedy"), a sigmoid one V3's ("noaux_tc", with the
    exp_probs_b correction bias); no gating key: softmax (older files, as llama.cpp). Rope: the
    rope dims rotate in adjacent pairs (llama.cpp's "norm" rope, as HF's). YaRN: the file keeps
    ``0.1 * mscale_all_dim`` only; ``mscale`` is taken equal to it, as in every released V2/V3
    (their ratio, the cos/sin factor, is then 1)."""
    n_layers = config.num_hidden_layers
    rope = int(meta.get("rope.dimension_count", required=True))
    if meta.get("attention.key_length_mla") is not None:
        qk_head = int(meta.get("attention.key_length_mla"))
        v_head = int(meta.get("attention.value_length_mla", required=True))
    else:
        qk_head = int(meta.get("attention.key_length", required=True))
        v_head = int(meta.get("attention.value_length", required=True))
    q_lora = int(meta.get("attention.q_lora_rank", 0) or 0)
    config.q_lora_rank = q_lora if q_lora and meta.has_tensor("blk.0.attn_q_a.weight") else None
    config.kv_lora_rank = int(meta.get("attention.kv_lora_rank", required=True))
    config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim = rope, qk_head - rope, v_head
    config.head_dim = qk_head
    config.num_key_value_heads = config.num_attention_heads  # (adapt_mla_config's convention)
    config.attention_bias, config.rope_interleave = False, True
    first_dense = min(int(meta.get("leading_dense_block_count", 0)), n_layers)
    config.mlp_only_layers = list(range(first_dense))
    if first_dense < n_layers:
        config.num_experts = int(meta.get("expert_count", required=True))
        config.num_experts_per_tok = int(meta.get("expert_used_count", required=True))
        config.moe_intermediate_size = int(meta.get("expert_feed_forward_length", required=True))
        config.n_shared_experts = int(meta.get("expert_shared_count", 0))
        config.routed_scaling_factor = float(meta.get("expert_weights_scale", 0.0) or 1.0)
        config.norm_topk_prob = bool(meta.get("expert_weights_norm", False))
        config.n_group = int(meta.get("expert_group_count", 1) or 1)
        config.topk_group = int(meta.get("expert_group_used_count", 1) or 1)
        check_expert_stacks(meta, config)
    gating = int(meta.get("expert_gating_func", _GATING_SOFTMAX))
    if gating == _GATING_SIGMOID:
        config.architecture, config.topk_method, config.scoring_func = "deepseek_v3", "noaux_tc", "sigmoid"
    elif gating == _GATING_SOFTMAX:
        config.architecture, config.scoring_func = ARCHITECTURE, "softmax"
        config.topk_method = "group_limited_greedy" if config.n_group > 1 else "greedy"
    else:
        raise ConfigError(f"{meta.path}: expert gating function {gating} is not supported (1 softmax, 2 sigmoid)")
    config.rope_scaling = _gguf_yarn(meta)
    check_deepseek_config(config)


def _gguf_yarn(meta: GGUFMetadata) -> Optional[dict[str, Any]]:
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ConfigError(f"{meta.path}: rope scaling '{kind}' is not supported for deepseek2 (yarn only)")
    scaling: dict[str, Any] = {
        "rope_type": "yarn", "factor": float(meta.get("rope.scaling.factor", required=True)),
        "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length", required=True)),
        "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
    }
    log_multiplier = meta.get("rope.scaling.yarn_log_multiplier")
    if log_multiplier:
        # (a float32 in the file: 0.1 * 0.707 reads back as 0.07069999...; rounded to the
        # digits a config gives, the mscale is the config's)
        scaling["mscale"] = scaling["mscale_all_dim"] = round(float(log_multiplier) / 0.1, 6)
    return scaling


# GGUF: ``exp_probs_b.bias`` is V3's e_score_correction_bias; ``attn_k_b`` + ``attn_v_b`` (newer
# files) are read together as kv_b_proj.
GGUF_LAYOUTS = (GGUFLayout("deepseek2", ARCHITECTURE, {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **ROUTER_NAMES,
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}, expert_names=EXPERT_STACK_NAMES, kv_b_split=("attn_k_b", "attn_v_b"), rope_by_adapt=True,
    adapt=adapt_gguf_config),)
