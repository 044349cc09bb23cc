"""Tiny random-weight models for fast tests, and bridges to HF transformers for parity checks.

The tiny models use SmolLM2's 49152-token vocabulary so the real SmolLM2 tokenizer can
drive them (bos 1, eos 2).
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable

import torch
from torch import nn

from kvserve.config import ConfigError, ModelConfig
from kvserve.models import deepseek_v2, deepseek_v3, gemma3, llama, mistral, phi3, qwen3, qwen3_moe
from kvserve.models.base import PagedCausalLM
from kvserve.models.layers import GemmaRMSNorm, RMSNorm
from kvserve.models.registry import get_model_class

TINY_ARCHITECTURES = ("llama", "gemma3", "gemma3-swa", "gemma3-pairs", "qwen3", "qwen3_moe", "phi3", "mistral-swa",
                      "deepseek_v2", "deepseek_v3")

TINY_MODELS = {"tiny-llama": "llama", "tiny-gemma3": "gemma3", "tiny-gemma3-swa": "gemma3-swa",
               "tiny-gemma3-pairs": "gemma3-pairs", "tiny-qwen3": "qwen3", "tiny-qwen3-moe": "qwen3_moe", "tiny-phi3": "phi3",
               "tiny-mistral-swa": "mistral-swa", "tiny-deepseek-v2": "deepseek_v2", "tiny-deepseek-v3": "deepseek_v3"}
# Each architecture's module holds its tiny configs (models/<arch>.py's tiny_config).
_TINY_BY_MODULE: dict[str, Callable[[], ModelConfig]] = {
    "llama": llama.tiny_config, "gemma3": gemma3.tiny_config,
    "gemma3-swa": functools.partial(gemma3.tiny_config, "swa"),
    "gemma3-pairs": functools.partial(gemma3.tiny_config, "pairs"),
    "qwen3": qwen3.tiny_config, "qwen3_moe": qwen3_moe.tiny_config, "phi3": phi3.tiny_config,
    "mistral-swa": mistral.tiny_config,
    "deepseek_v2": deepseek_v2.tiny_config, "deepseek_v3": deepseek_v3.tiny_config,
}
# Tiny models with other head counts, for tensor-parallel tests: "tiny-llama-h6kv2" is
# tiny-llama with 6 query and 2 KV heads, "tiny-llama-h4kv2d32" the same with a head dimension
# of 32 (models.testing.tiny_config_by_name).
TINY_HEADS_PATTERN = re.compile(r"^(tiny-llama|tiny-gemma3|tiny-qwen3|tiny-qwen3-moe|tiny-phi3)-h(\d+)kv(\d+)(?:d(\d+))?$")


def tiny_config(arch: str) -> ModelConfig:
    """The tiny config of ``arch`` (a TINY_ARCHITECTURES entry), from its module."""
    if arch not in _TINY_BY_MODULE:
        raise ConfigError(f"no tiny model for architecture '{arch}' (have: {', '.join(TINY_ARCHITECTURES)})")
    return _TINY_BY_MODULE[arch]()


def tiny_config_by_name(name: str) -> ModelConfig:
    """``tiny-llama`` / ``tiny-gemma3``, or ``tiny-<arch>-h<Q>kv<KV>[d<D>]``: the same model with
    Q query and KV key/value heads (of D dimensions) and an intermediate size of 192 (divisible
    by 2, 3, 4 and 6), shaped for a tensor-parallel case (KV heads split across ranks, or
    replicated) or a kernel's head dimension (the AMX attention tiles take multiples of 32)."""
    if name in TINY_MODELS:
        return tiny_config(TINY_MODELS[name])
    m = TINY_HEADS_PATTERN.match(name)
    if m is None:
        raise ConfigError(f"unknown tiny model {name!r}")
    config = tiny_config(TINY_MODELS[m.group(1)])
    q, kv = int(m.group(2)), int(m.group(3))
    if q < 1 or kv < 1 or q % kv:
        raise ConfigError(f"{name}: query heads must be a positive multiple of KV heads")
    config.num_attention_heads, config.num_key_value_heads = q, kv
    if m.group(4):
        head_dim = int(m.group(4))
        if head_dim < 2 or head_dim % 2:
            raise ConfigError(f"{name}: the head dimension must be even")
        config.head_dim = head_dim
    config.intermediate_size = 192
    config.name = name
    return config


@torch.no_grad()
def build_random_model(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> PagedCausalLM:
    """A model with deterministic random weights, scaled so activations and logits stay O(1)
    to O(10) (peaked enough that greedy decoding is not decided by rounding noise)."""
    model = get_model_class(config.architecture)(config)
    gen = torch.Generator().manual_seed(seed)
    norm_modules = {name for name, m in model.named_modules() if isinstance(m, (RMSNorm, GemmaRMSNorm))}
    gemma_norms = {name for name, m in model.named_modules() if isinstance(m, GemmaRMSNorm)}
    for name, param in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        noise = torch.randn(param.shape, generator=gen)
        if owner in norm_modules:
            value = 0.1 * noise if owner in gemma_norms else 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            value = 0.1 * noise
        elif param.dim() == 2 and "embed_tokens" not in name:
            value = noise / math.sqrt(param.shape[1])
        else:
            value = noise
        param.copy_(value)
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()


def unfused_state_dict(model: PagedCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under upstream (HF) names: fused projections split back."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, tensor in model.state_dict().items():
        module_name, attr = name.rsplit(".", 1)
        fused = module_name.rsplit(".", 1)[-1]
        if fused not in model.packed_modules:
            out[name] = tensor
            continue
        parent = module_name.rsplit(".", 1)[0]
        parts = model.packed_modules[fused]
        sizes = _shard_sizes(modules[parent], fused, tensor.shape[0], len(parts))
        for part, piece in zip(parts, tensor.split(sizes, dim=0)):
            out[f"{parent}.{part}.{attr}"] = piece.clone()
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


def hf_module_state_dict(model: PagedCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights as transformers 5's modules hold them (for a reference model's
    ``load_state_dict``): ``unfused_state_dict``, except that routed experts are stacked
    into 3-D ``mlp.experts.gate_up_proj [E, 2 x width, hidden]`` (each expert's gate rows,
    then its up rows: kvserve's fused layout) and ``mlp.experts.down_proj [E, hidden, width]``.
    Checkpoints (``save_pretrained``) keep one tensor per expert, as ``unfused_state_dict``."""
    state = unfused_state_dict(model)
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        m = _EXPERT_WEIGHT.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = tensor
    for (prefix, proj), per_expert in experts.items():
        for e in per_expert:
            for part in (("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)):
                state.pop(f"{prefix}.{e}.{part}.weight")
        state[f"{prefix}.{proj}"] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    return state


def _shard_sizes(parent: nn.Module, fused: str, rows: int, count: int) -> list[int]:
    if fused == "qkv_proj":
        return list(parent.split_sizes)
    return [rows // count] * count


def to_hf_config(config: ModelConfig) -> Any:
    """An HF transformers config describing the same architecture (for reference models)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
    )
    if config.rope_scaling:
        common["rope_scaling"] = dict(config.rope_scaling)
    if config.architecture in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_hf_config(config)
    if config.architecture == "gemma3":
        return Gemma3TextConfig(
            rope_local_base_freq=config.rope_local_base_freq, sliding_window=config.sliding_window,
            layer_types=list(config.layer_types), query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),
            hidden_activation=config.hidden_act, final_logit_softcapping=config.final_logit_softcapping,
            attn_logit_softcapping=config.attn_logit_softcapping, attention_bias=config.attention_bias,
            **common,
        )
    if config.architecture == "qwen2":
        return Qwen2Config(hidden_act=config.hidden_act, **common)
    if config.architecture == "qwen3":
        return Qwen3Config(hidden_act=config.hidden_act, attention_bias=config.attention_bias, **common)
    if config.architecture == "phi3":
        scaling = config.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        return Phi3Config(hidden_act=config.hidden_act, sliding_window=config.sliding_window, pad_token_id=None,
                          original_max_position_embeddings=original, **common)
    if config.architecture == "mistral":
        return MistralConfig(hidden_act=config.hidden_act, sliding_window=config.sliding_window, **common)
    return LlamaConfig(hidden_act=config.hidden_act, attention_bias=config.attention_bias,
                       mlp_bias=config.mlp_bias, **common)


def _deepseek_hf_config(config: ModelConfig) -> Any:
    """DeepseekV2Config / DeepseekV3Config of ``config``'s shape (MLA, experts, routing)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    first_dense = len(config.mlp_only_layers)
    assert config.mlp_only_layers == list(range(first_dense)), "DeepSeek's dense layers come first"
    kwargs: dict[str, Any] = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
        hidden_act=config.hidden_act, attention_bias=config.attention_bias,
        rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default", **(config.rope_scaling or {})},
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
        n_routed_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size, n_shared_experts=config.n_shared_experts,
        routed_scaling_factor=config.routed_scaling_factor, n_group=config.n_group, topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob, first_k_dense_replace=first_dense,
    )
    if config.architecture == "deepseek_v2":
        return DeepseekV2Config(topk_method=config.topk_method, mlp_bias=config.mlp_bias, **kwargs)
    return DeepseekV3Config(rope_interleave=config.rope_interleave, **kwargs)


def _int_if_whole(x: Any) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x
