"""Model loading: ``resolve_model(spec)`` finds and validates a model, ``load_model`` builds it."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.loader.gguf import config_from_gguf, iter_gguf_weights, open_gguf
from kvserve.loader.resolve import ModelSource, resolve_model
from kvserve.loader.safetensors import config_from_hf, iter_safetensors_weights, read_hf_config
from kvserve.models.registry import get_model_class

__all__ = ["ModelSource", "resolve_model", "load_model", "build_model"]


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    """Instantiate the architecture without initialising it (meta device), then assign the
    upstream-named ``weights`` converted to ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights)
    model.requires_grad_(False)
    return model.eval()


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu",
               quantization: str | None = None) -> tuple[nn.Module, ModelConfig]:
    """Build the model; ``quantization`` ("bf16" | "int8" | "int4") stores the linear layers'
    weights in that format (activations stay in ``dtype``), reusing the GGUF's Q4_1 blocks
    for int4 where there are any."""
    model, config = _load_float_model(source, dtype, device)
    if quantization:
        from kvserve.quant import convert_linear_layers

        raw = None
        if source.kind == "gguf" and quantization == "int4":
            from kvserve.loader.gguf import quantized_weights
            raw = quantized_weights(open_gguf(source.path), config)
        convert_linear_layers(model, quantization, raw)
    elif dtype == torch.float32:
        # fp32 weights through kvserve's batch-invariant kernel rather than MKL's sgemm.
        from kvserve.quant import use_invariant_fp32_linears
        use_invariant_fp32_linears(model)
    from kvserve.models.fused import attach_fused_layers
    attach_fused_layers(model)
    return model, config


def _load_float_model(source: ModelSource, dtype: torch.dtype,
                      device: torch.device | str) -> tuple[nn.Module, ModelConfig]:
    if source.kind == "tiny":
        from kvserve.loader.resolve import TINY_MODELS
        from kvserve.models.testing import build_random_model, tiny_config

        config = tiny_config(TINY_MODELS[source.name])
        return build_random_model(config, seed=0, dtype=dtype, device=device), config
    if source.kind == "gguf":
        gf = open_gguf(source.path)
        config = config_from_gguf(gf)
        weights = iter_gguf_weights(gf, config)
    elif source.kind == "hf_dir":
        config = config_from_hf(read_hf_config(source.path))
        weights = iter_safetensors_weights(source.path)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    config.name = source.name
    return build_model(config, weights, dtype, device), config
