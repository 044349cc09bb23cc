"""The decoder layers as one native call per step (fp32 activations on the CPU).

Driving a small model's layers from Python costs about a dozen calls per layer at a few
microseconds each (norms, projections, rope, cache write, attention, activation, residual
adds): ~5 ms per step for SmolLM2's 30 layers whatever the batch. With int4 weights a
single-stream decode step reads ~70 MB, about 3 ms at this machine's memory bandwidth, so
that overhead was more than half the step; in batched steps it is 5-10 %.
``FusedDecoderLayers`` hands the layer loop to C++ (kvserve/csrc/decoder.cpp), which calls
the same kernels and torch ops the Python model calls, in the same order, on the same
weights: the results are identical, the Python model stays the reference, and the tests
hold the two together.

It is attached (``attach_fused_layers``, by the loader) when the architecture's declared
layer (``layer_spec``, models/spec.py: which norms, QK-norm, rope tables, MLP kind) fits the
native skeleton, every linear layer of the decoder is one of kvserve's formats or a plain
fp32 ``nn.Linear`` (what the decoder passes to call each: kvserve.quant.registry), the
activations are fp32 on the CPU and the extension is built; otherwise the model runs layer
by layer (as MLA and DeepSeek's routed experts always do).

Routed experts (Qwen3-MoE's softmax top-k) run natively too: the router's exact fp32 logits,
the routing kernel the Python model calls (csrc/moe_routing.cpp), then each chosen expert's
two linears through the same calls as a dense MLP's, on its tokens' rows only, the k weighted
results added in ascending expert order, as models/moe.py does. Layer by layer, the Python
loop over the experts (dozens of small torch ops per layer) made a batch-1 decode step of a
48-layer, 128-expert, top-8 model 1.7-1.8x (earlier measured ~3x) a dense model of its active
parameters; natively 1.12x in bf16, 1.36x in int4 (benchmarks/moe_decode.py, a 2-core Ice Lake
Xeon).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.attention import AttentionMetadata
from kvserve.kv_cache import KVCache
from kvserve.models.spec import DecoderLayerSpec
from kvserve.quant import native_linear_args
from kvserve.quant.common import batch_invariant_linears
from kvserve.row_table import kernels_read
from kvserve.token_roles import ALL_GENERATED, current_token_roles

logger = logging.getLogger(__name__)


def _router_args(router: nn.Module) -> Optional[tuple]:
    """decoder.cpp's ``Linear`` for a MoERouter (models/moe.py): the call its forward makes on
    fp32 activations, kvserve's fp32 kernel or torch's linear, on its exact fp32 weights."""
    weight = router.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return ("fp32" if batch_invariant_linears() else "dense"), weight, None, None


def _mlp_args(mlp: nn.Module, routed: bool) -> Optional[dict[str, Any]]:
    """The native loop's arguments for a layer's MLP: a gated MLP's two linears, or (``routed``)
    a softmax top-k block's router, experts (each a gated MLP's two linears) and routing
    (qwen3_moe.SparseMoEBlock's fields); None where a linear is not one the loop calls."""
    if not routed:
        args = {"gate_up": native_linear_args(mlp.gate_up_proj), "down": native_linear_args(mlp.down_proj)}
        return None if any(a is None for a in args.values()) else args
    gate_up = [native_linear_args(expert.gate_up_proj) for expert in mlp.experts]
    down = [native_linear_args(expert.down_proj) for expert in mlp.experts]
    router = _router_args(mlp.gate)
    if router is None or any(a is None for a in gate_up + down):
        return None
    return {"router": router, "experts_gate_up": gate_up, "experts_down": down, "top_k": int(mlp.top_k),
            "normalize": bool(mlp.normalize)}


def _layer_spec(layer: nn.Module, spec: DecoderLayerSpec, routed: bool) -> Optional[dict[str, Any]]:
    """What the native loop needs of one decoder layer, as its architecture declares it
    (``spec``: which norms it has and where; ``routed``: routed experts in place of the MLP),
    or None where a linear's format or the activation is not one the native loop calls."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = {"qkv": attn.qkv_proj, "o": attn.o_proj}
    specs = {name: native_linear_args(module) for name, module in linears.items()}
    mlp_args = _mlp_args(mlp, routed)
    if any(spec is None for spec in specs.values()) or mlp_args is None or mlp.hidden_act not in ops.ACTIVATION_CODES:
        return None

    def norm(name: Optional[str]) -> Optional[torch.Tensor]:
        return None if name is None else layer.get_submodule(name).weight

    return {
        **specs,
        **mlp_args,
        "input_norm": layer.input_layernorm.weight,
        "pre_ffn_norm": norm(spec.pre_ffn_norm),
        "post_attn_norm": norm(spec.post_attn_norm),
        "post_ffn_norm": norm(spec.post_ffn_norm),
        "q_norm": attn.q_norm.weight if spec.qk_norm else None,
        "k_norm": attn.k_norm.weight if spec.qk_norm else None,
        "scale": float(attn.scale),
        "window": int(attn.sliding_window or 0),
        "softcap": float(attn.softcap or 0.0),
        "local_rope": spec.local_rope and bool(attn.is_sliding),
    }


class FusedDecoderLayers:
    """``layer_N(...layer_1(embedding(input_ids)))`` for one step, in one native call: the
    decoder's output before its final norm."""

    def __init__(self, native: Any) -> None:
        self.native = native

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 embed_table: tuple[torch.Tensor, Optional[torch.Tensor]],
                 embed_scale: float, rope_tables: tuple[torch.Tensor, torch.Tensor],
                 local_rope_tables: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata,
                 kv_caches: KVCache, output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step from its tokens: the embedding rows of ``input_ids`` (``embed_table``:
        kvserve.row_table.table_args of the model's embedding) times ``embed_scale``
        and the rope tables' rows at ``positions`` (``RopeFrequencies.tables``, covering them;
        the local ones may be the same) are read natively, the values the model's own ops give.
        Per step that is half a dozen fewer small torch ops and tensors from Python, each of
        which finds its code and data evicted by the weights the last step streamed.
        ``output_rows``: the rows whose hidden states are returned (the model's forward)."""
        md = attn_metadata
        data, scales, groups = kv_caches.native_views
        roles = current_token_roles()  # None: every row generated (the 4-bit weights)
        kind = ALL_GENERATED if roles is None else roles.kind
        return self.native.forward_tokens(input_ids, positions, *embed_table, embed_scale, *rope_tables,
                                          *local_rope_tables, data, scales, groups, md.all_slot_mappings(),
                                          md.all_block_tables(), md.seq_lens_tensor, md.query_start_loc_tensor,
                                          kind, None if roles is None else roles.prompt_rows,
                                          None if roles is None else roles.generated_rows, output_rows)

    def decode_round(self, num_steps: int, input_ids: torch.Tensor, positions: torch.Tensor, block_size: int,
                     fused_inputs: tuple, attn_metadata: AttentionMetadata, kv_caches: KVCache, norm: Any,
                     screen_call: tuple) -> torch.Tensor:
        """``num_steps`` greedy decode steps, natively (decoder.cpp's decode_round: the first on
        the inputs as they are, each later one fed back the argmax before it, one position on,
        advancing ``input_ids``, ``positions`` and the metadata's slots and lengths in place):
        the tokens ``[num_steps, rows]``. ``fused_inputs``: the model's ``fused_inputs`` covering
        the round's last position; ``norm``: the final norm; ``screen_call``:
        RescoredLMHead.native_screen's."""
        md = attn_metadata
        data, scales, groups = kv_caches.native_views
        embed_table, embed_scale, tables, local_tables = fused_inputs
        logits, screen, exact, exact_scales, top_k = screen_call
        return self.native.decode_round(num_steps, input_ids, positions, block_size, *embed_table,
                                        embed_scale, *tables, *local_tables, data, scales, groups,
                                        md.all_slot_mappings(), md.all_block_tables(), md.seq_lens_tensor,
                                        md.query_start_loc_tensor, norm.weight, norm.eps, norm.offset, screen, exact,
                                        exact_scales, top_k, logits)

    def applies_to(self, embedding: nn.Module, kv_caches: KVCache) -> bool:
        """Whether a step runs here: the kernels read the model's embedding table and the cache."""
        return kernels_read(embedding) and kv_caches.is_contiguous


def attach_fused_layers(model: nn.Module) -> Optional[FusedDecoderLayers]:
    """Give ``model.model`` a ``fused_layers`` when every decoder layer qualifies."""
    decoder = model.model
    decoder.fused_layers = None
    ext = ops.load_extension()
    params = list(decoder.parameters())
    if ext is None or any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        return None  # the kernels are fp32-only; pure bf16 models and CUDA run layer by layer
    layer_spec: DecoderLayerSpec = model.layer_spec  # the architecture's declaration (models/spec.py)
    if not layer_spec.native:
        return None  # e.g. MLA, DeepSeek's routing: they run layer by layer
    cfg = model.config
    routed = [layer_spec.mlp == "moe" and cfg.is_moe_layer(i) for i in range(len(decoder.layers))]
    specs = [_layer_spec(layer, layer_spec, moe) for layer, moe in zip(decoder.layers, routed)]
    if any(spec is None for spec in specs):
        return None
    native = ext.FusedDecoderLayers(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                    float(cfg.rms_norm_eps), layer_spec.norm_offset,
                                    ops.ACTIVATION_CODES[decoder.layers[0].mlp.hidden_act], specs)
    decoder.fused_layers = FusedDecoderLayers(native)
    logger.info("decoder layers run as one native call per step")
    return decoder.fused_layers
