"""Gemma 3 (text) decoder on the paged KV cache.

Differences from LLaMA: sliding-window (local) layers interleaved with global ones, each
kind with its own rope base (rope scaling applies to global layers only); RMSNorm on q and
k per head (QK-norm); ``(1 + w)`` RMSNorms, also after attention and after the MLP; GeGLU
(tanh-approximated GELU); embeddings scaled by ``sqrt(hidden_size)``; attention scale
``query_pre_attn_scalar ** -0.5``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.attention import AttentionMetadata, paged_attention
from kvserve.kv_cache import KVCache, LayerKV
from kvserve.config import ModelConfig
from kvserve.distributed import ParallelGroup, PipelineStage
from kvserve.models.base import PagedCausalLM
from kvserve.models.gguf_layout import LLAMA_BLOCK_NAMES, QK_NORM_NAMES, GGUFLayout, GGUFMetadata
from kvserve.models.spec import DecoderLayerSpec
from kvserve.models.layers import GemmaRMSNorm, RopeFrequencies, output_projection, token_embedding
from kvserve.row_table import table_args
from kvserve.token_roles import roles_of_rows
from kvserve.models.llama import GatedMLP

if TYPE_CHECKING:
    from kvserve.models.fused import FusedDecoderLayers


class Gemma3Attention(nn.Module):
    tp: Optional[ParallelGroup] = None  # this rank's heads; o_proj's partial sums all-reduced

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.is_sliding = config.is_sliding(layer_idx)
        self.sliding_window = config.sliding_window if self.is_sliding else None
        self.softcap = config.attn_logit_softcapping

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: LayerKV, output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T, hidden] -> the attention block's output for ``output_rows`` of them (None: all)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        ops.rope_qk_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, norm_offset=1.0)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window, self.softcap)
        y = output_projection(self.o_proj, out.reshape(n, -1), output_rows)
        return y if self.tp is None else self.tp.all_reduce(y)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, hidden: torch.Tensor, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata, kv_cache: LayerKV,
                output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's output for ``output_rows`` of the step (None: every row)."""
        cos, sin = rope[self.self_attn.is_sliding]
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, attn_metadata, kv_cache, output_rows)
        if output_rows is not None:
            hidden = hidden.index_select(0, output_rows)
        with roles_of_rows(output_rows):
            hidden = hidden + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
            return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    pp: Optional[PipelineStage] = None  # as LlamaModel's

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Global layers: the configured rope (and its scaling); sliding layers: their own base.
        self.rope_inv_freq = RopeFrequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.local_rope_inv_freq = RopeFrequencies(config.head_dim, config.rope_local_base_freq or config.rope_theta,
                                                   None)
        self.fused_layers: Optional[FusedDecoderLayers] = None  # kvserve.models.fused attaches it
        self._embed_scales: dict[torch.dtype, float] = {}

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded as HF rounds it, once per dtype (three ops a step otherwise)."""
        if dtype not in self._embed_scales:
            self._embed_scales[dtype] = torch.tensor(self.config.hidden_size ** 0.5).to(dtype).item()
        return self._embed_scales[dtype]

    def fused_inputs(self, num_positions: int, device: torch.device) -> tuple:
        """What the fused layers read besides the step: (the embedding table's arguments
        (kvserve.row_table.table_args), its scale, global and local rope tables covering
        ``num_positions``)."""
        return (table_args(self.embed_tokens), self._embed_scale(torch.float32),
                self.rope_inv_freq.tables(num_positions, device), self.local_rope_inv_freq.tables(num_positions, device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: KVCache, output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As LlamaModel.forward: the hidden states of ``output_rows`` (None: every row)."""
        cfg = self.config
        fused = self.fused_layers
        if fused is not None and fused.applies_to(self.embed_tokens, kv_caches):
            return fused(input_ids, positions, *self.fused_inputs(attn_metadata.max_seq_len, input_ids.device),
                         attn_metadata, kv_caches, output_rows)
        if self.pp is None or self.pp.is_first:
            hidden = self.embed_tokens(input_ids)
            # HF rounds the scale to float32 and then to the weights' dtype before multiplying;
            # so do we (in bf16, sqrt(640) becomes 25.25). A host-side scalar: no device sync.
            hidden = hidden * self._embed_scale(hidden.dtype)
        else:
            hidden = self.pp.recv(input_ids.shape[0], cfg.hidden_size, self.norm.weight.dtype,
                                  input_ids.device)
        rope = {
            False: self.rope_inv_freq.cos_sin(positions, hidden.dtype, attn_metadata.max_seq_len),
            True: self.local_rope_inv_freq.cos_sin(positions, hidden.dtype, attn_metadata.max_seq_len),
        }
        last = len(self.layers) - 1  # (output_rows: None on a stage before the last)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, rope, attn_metadata, kv_cache, output_rows if i == last else None)
        if self.pp is not None and not self.pp.is_last:
            self.pp.send(hidden)
        return hidden  # pre-norm: the caller norms only the rows it needs logits for


class Gemma3ForCausalLM(PagedCausalLM):
    layer_spec = DecoderLayerSpec(norm_offset=1.0, qk_norm=True, pre_ffn_norm="pre_feedforward_layernorm",
                                  post_attn_norm="post_attention_layernorm",
                                  post_ffn_norm="post_feedforward_layernorm", local_rope=True)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()


def tiny_config(variant: str = "") -> ModelConfig:
    """Random-weight test models on SmolLM2's vocabulary (its tokenizer drives them).
    "": tiny-gemma3, 4 layers, window 8. "swa": Gemma 3's 5 sliding : 1 global pattern with a
    window of two 16-token blocks and room for thousands of tokens (sliding-window KV groups and
    their block reclaim). "pairs": 2 sliding : 1 global, twice, window 8: KV cache groups of two
    layers each (global (2, 5), sliding (0, 1) and (3, 4)), so that a pipeline stage holds some
    groups whole and the global group in part (layer 5 alone: the stage's slot 0, the model's
    slot 1)."""
    shapes = {
        "": (["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"], 8, 4096),
        "swa": (["sliding_attention"] * 5 + ["full_attention"], 32, 8192),
        "pairs": (["sliding_attention", "sliding_attention", "full_attention"] * 2, 8, 4096),
    }
    layer_types, window, context = shapes[variant]
    return ModelConfig(
        architecture="gemma3", vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=context, rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4,
        hidden_act="gelu_pytorch_tanh", sliding_window=window, layer_types=layer_types,
        query_pre_attn_scalar=16.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2],
        name="tiny-gemma3" + (f"-{variant}" if variant else ""),
    )


def adapt_gguf_config(meta: GGUFMetadata, config: ModelConfig) -> None:
    """Gemma 3 from a GGUF file. Some hyper-parameters are not in the file at all and are
    llama.cpp constants: local rope base 10000, a sliding/global pattern of 6 (older files),
    attention scale ``head_dim ** -0.5`` (except 27B: 62 layers)."""
    n_layers = config.num_hidden_layers
    window = meta.get("attention.sliding_window")
    config.hidden_act = "gelu_pytorch_tanh"
    config.rope_local_base_freq = 10000.0
    config.sliding_window = int(window) if window else None
    pattern = meta.get("attention.sliding_window_pattern")
    if pattern is not None and hasattr(pattern, "__len__"):  # newer files: one bool per layer
        config.layer_types = ["sliding_attention" if p else "full_attention" for p in list(pattern)]
    else:
        period = int(pattern) if pattern is not None else 6
        config.layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                              for i in range(n_layers)]
    hidden, heads = config.hidden_size, config.num_attention_heads
    config.query_pre_attn_scalar = float(hidden // heads if n_layers == 62 else config.head_dim)


# GGUF: every norm stored as 1 + w; the norms after attention and around the MLP under their own names.
GGUF_LAYOUTS = (GGUFLayout("gemma3", "gemma3", {
    **LLAMA_BLOCK_NAMES, **QK_NORM_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}, norms_plus_one=True, adapt=adapt_gguf_config),)
