"""Model loading: ``resolve_model(spec)`` finds and validates a model, ``load_model`` builds it."""
from __future__ import annotations

import ctypes
import re
from typing import Iterable, Optional

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.distributed import ParallelGroup, PipelineStage
from kvserve.loader.gguf import config_from_gguf, iter_gguf_weights, open_gguf
from kvserve.loader.resolve import ModelSource, resolve_model
from kvserve.loader.safetensors import config_from_hf, iter_safetensors_weights, read_hf_config
from kvserve.models.registry import get_model_class

__all__ = ["ModelSource", "resolve_model", "load_model", "load_config", "build_model", "source_has_blocks"]


def source_has_blocks(source: ModelSource) -> bool:
    """Whether the model is a GGUF file that stores some matrix in a block format."""
    from kvserve.loader.gguf_blocks import has_quantized_matrices
    return source.kind == "gguf" and has_quantized_matrices(open_gguf(source.path))


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                tp: Optional[ParallelGroup] = None, pp: Optional[PipelineStage] = None) -> nn.Module:
    """Instantiate the architecture without initialising it (meta device), then assign the
    upstream-named ``weights`` converted to ``dtype`` on ``device``. With ``tp`` (several
    ranks) the model is this rank's shard: each weight is sliced as it streams past, before
    conversion, so the full model is never held."""
    plan = None
    with torch.device("meta"):
        if tp is not None and tp.world_size > 1:
            from kvserve.models.tensor_parallel import TPShardPlan, local_config, shard_model_in_place
            plan = TPShardPlan(config, tp.rank, tp.world_size)
            model = get_model_class(config.architecture)(local_config(config, tp.world_size))
            shard_model_in_place(model, plan, tp)
        else:
            model = get_model_class(config.architecture)(config)
        if pp is not None:
            model.model.layers = nn.ModuleList(list(model.model.layers)[pp.layer_range[0]:pp.layer_range[1]])
            model.pp = model.model.pp = pp
    if pp is not None:
        weights = _stage_weights(weights, *pp.layer_range)
    if plan is not None:
        weights = ((name, plan.shard_weight(name, t)) for name, t in weights)
    model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights)
    model.requires_grad_(False)
    return model.eval()


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _stage_weights(weights: Iterable[tuple[str, torch.Tensor]], start: int, end: int):
    """A pipeline stage's weights: its layers' (renumbered from 0) and the rest (embedding,
    final norm, LM head: every stage loads them; only the first and last use them)."""
    for name, tensor in weights:
        m = _LAYER_NAME.match(name)
        if m is None:
            yield name, tensor
        elif start <= int(m.group(1)) < end:
            yield f"model.layers.{int(m.group(1)) - start}.{name[m.end():]}", tensor


def load_config(source: ModelSource) -> ModelConfig:
    """The model's configuration without its weights (what the engine needs when the weights
    live in worker processes)."""
    if source.kind == "tiny":
        from kvserve.models.testing import tiny_config_by_name
        return tiny_config_by_name(source.name)
    if source.kind == "gguf":
        config = config_from_gguf(open_gguf(source.path))
    elif source.kind == "hf_dir":
        config = config_from_hf(read_hf_config(source.path))
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    config.name = source.name
    return config


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu",
               quantization: str | None = None,
               tp: Optional[ParallelGroup] = None,
               pp: Optional[PipelineStage] = None,
               int4_prefill: str = "auto") -> tuple[nn.Module, ModelConfig]:
    """Build the model (this rank's shard with ``tp``, its stage's layers with ``pp``);
    ``quantization`` "gguf": a GGUF's linear layers on the file's own blocks, no float copy
    (kvserve.loader.gguf_blocks; shards, stages and CUDA take "int4" instead); ("bf16" | "int8" | "int4") stores the linear layers' weights in that format (activations stay in ``dtype``),
    reusing the GGUF's Q4_1 blocks for int4 where there are any; ``int4_prefill``: which int4
    layers also hold a copy of their weights (bf16 or int8) for prompt tokens
    (kvserve.quant.convert_linear_layers); with "gguf", "int8" computes prompt tokens on the
    blocks under int8 activations where the kernel reads them (kvserve.quant.use_int8_prompts),
    the other modes under the decode rows' 16-bit ones."""
    sharded = tp is not None and tp.world_size > 1
    if quantization == "gguf" and source.kind != "gguf":
        quantization = None  # (a draft model from safetensors: its own format, float)
    if quantization == "gguf":
        if sharded or pp is not None or torch.device(device).type != "cpu" or dtype != torch.float32:
            # Shards and stages are cut from float weights; the 4-bit mode reads the file's
            # blocks where it can.
            quantization, int4_prefill = "int4", "blocks"
        else:
            from kvserve.loader.gguf_blocks import build_gguf_model
            from kvserve.models.fused import attach_fused_layers

            gf = open_gguf(source.path)
            config = config_from_gguf(gf)
            config.name = source.name
            model, counts = build_gguf_model(gf, config)
            model.weight_format_counts = counts
            if int4_prefill == "int8":
                from kvserve.quant import use_int8_prompts
                use_int8_prompts(model)
            attach_fused_layers(model)
            return_freed_heap()
            return model, config
    model, config = _load_float_model(source, dtype, device, tp if sharded else None, pp)
    if quantization:
        from kvserve.quant import convert_linear_layers

        raw = None
        if source.kind == "gguf" and quantization == "int4":
            from kvserve.loader.gguf import quantized_weights
            raw = quantized_weights(open_gguf(source.path), config)
            if sharded:
                from kvserve.models.tensor_parallel import TPShardPlan
                plan = TPShardPlan(config, tp.rank, tp.world_size)
                raw = {name: part for name, qt in raw.items()
                       if (part := plan.shard_raw(name, qt)) is not None}
            if pp is not None:
                raw = dict(_stage_weights(raw.items(), *pp.layer_range))
        model.weight_format_counts = convert_linear_layers(model, quantization, raw, int4_prefill)
    elif dtype == torch.float32:
        # fp32 weights through kvserve's batch-invariant kernel rather than MKL's sgemm.
        from kvserve.quant import use_invariant_fp32_linears
        use_invariant_fp32_linears(model)
    if not sharded and pp is None:
        # The native whole-stack decoder has no collectives: tensor-parallel ranks run the
        # modules (with kvserve's linear kernels) one by one.
        from kvserve.models.fused import attach_fused_layers
        attach_fused_layers(model)
    return_freed_heap()
    return model, config


def return_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). Loading frees its
    temporaries (fp32 copies of every weight, unpacked blocks) in pieces of a few MB, which
    glibc serves from its heap once a freed large block has raised its mmap threshold, and
    keeps: SmolLM2's engine held 1185 MiB resident against 837 with the trim, Gemma 3's int4
    2734 against 2037 (benchmarks/results/zen3-avx2-engine-start). Elsewhere (other C
    libraries) nothing happens."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except Exception:  # no such C library function here (musl, macOS, Windows)
        pass


def _load_float_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str,
                      tp: Optional[ParallelGroup] = None,
                      pp: Optional[PipelineStage] = None) -> tuple[nn.Module, ModelConfig]:
    if source.kind == "tiny":
        from kvserve.models.testing import build_random_model, tiny_config_by_name, unfused_state_dict

        config = tiny_config_by_name(source.name)
        full = build_random_model(config, seed=0, dtype=dtype, device=device)
        if tp is None and pp is None:
            return full, config
        # Random test weights exist only as a whole model; its tensors are then streamed
        # through the same per-weight sharding as a checkpoint's.
        return build_model(config, unfused_state_dict(full).items(), dtype, device, tp, pp), config
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
    return build_model(config, weights, dtype, device, tp, pp), config
