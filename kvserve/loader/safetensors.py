"""HF model directory (``config.json`` + ``*.safetensors``) -> ``ModelConfig`` + weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

from kvserve.config import ConfigError, ModelConfig
from kvserve.models.registry import get_model_class

# HF model_type -> (kvserve architecture, tie_word_embeddings default of that HF config class)
HF_MODEL_TYPES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", False),
    "mistral": ("mistral", False),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "qwen3_moe": ("qwen3_moe", False),
    "phi3": ("phi3", False),
    "gemma3_text": ("gemma3", True),
    "deepseek_v2": ("deepseek_v2", False),
    "deepseek_v3": ("deepseek_v3", False),
}


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{model_dir}: no config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None


def _rope_settings(cfg: dict[str, Any], layer_kind: Optional[str]) -> tuple[float, Optional[dict]]:
    """(rope base, rope scaling) from either the transformers-5 ``rope_parameters`` layout
    (flat, or per layer type for Gemma 3) or the older ``rope_theta`` / ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_kind is not None and layer_kind in params:
        params = params[layer_kind]
    if isinstance(params, dict) and "rope_theta" in params:
        base = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        base = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "su":  # the first Phi-3 128k checkpoints' name for LongRoPE (HF reads it so too)
        kind = "longrope"
    if kind == "default":
        return base, None
    if kind not in ("linear", "llama3", "longrope", "yarn"):
        raise ConfigError(f"unsupported rope scaling '{kind}' (supported: linear, llama3, longrope, yarn)")
    scaling["rope_type"] = kind
    return base, scaling


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type '{model_type}' (supported: {', '.join(sorted(HF_MODEL_TYPES))})"
        )
    arch, tie_default = HF_MODEL_TYPES[model_type]
    hidden, n_heads, n_layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // n_heads
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]

    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if arch == "gemma3":
        window = window or 4096
        if not layer_types:
            period = int(cfg.get("sliding_window_pattern", 6))
            layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]
    elif not layer_types and window:
        if arch in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
            first = int(cfg.get("max_window_layers", 0))
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if not layer_types or "sliding_attention" not in layer_types:
        layer_types, window = None, None

    rope_theta, rope_scaling = _rope_settings(cfg, "full_attention" if arch == "gemma3" else None)
    config = ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        sliding_window=window,
        layer_types=layer_types,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=cfg.get("_name_or_path", ""),
    )
    if arch == "gemma3":
        config.query_pre_attn_scalar = float(cfg.get("query_pre_attn_scalar", 256))
        local_base, _ = _rope_settings(cfg, "sliding_attention")
        config.rope_local_base_freq = float(cfg.get("rope_local_base_freq", local_base if "rope_parameters" in cfg else 10000.0))
    get_model_class(arch).adapt_hf_config(cfg, config)  # the architecture's own part (models/<arch>.py)
    return config


def safetensors_files(model_dir: str | Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors"))


def iter_safetensors_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` from every ``*.safetensors`` file of the directory."""
    files = safetensors_files(model_dir)
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                    continue
                yield name, f.get_tensor(name)
