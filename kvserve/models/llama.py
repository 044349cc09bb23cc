"""LLaMA-family decoder on the paged KV cache: SmolLM2, Llama 2/3, Mistral, Qwen2.

GQA, optional q/k/v bias (Qwen2 biases q/k/v but not o), rope scaling (linear, llama3,
GGUF frequency factors), optional uniform sliding window (Mistral). Parameter names follow
HF's ``LlamaForCausalLM`` except the fused ``qkv_proj`` / ``gate_up_proj``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.attention import AttentionMetadata, paged_attention
from kvserve.kv_cache import KVCache, LayerKV
from kvserve.config import ConfigError, ModelConfig
from kvserve.distributed import ParallelGroup, PipelineStage
from kvserve.models.base import PagedCausalLM
from kvserve.models.gguf_layout import LLAMA_BLOCK_NAMES, GGUFLayout
from kvserve.models.layers import RMSNorm, RopeFrequencies, output_projection, token_embedding
from kvserve.row_table import table_args
from kvserve.token_roles import roles_of_rows

if TYPE_CHECKING:
    from kvserve.models.fused import FusedDecoderLayers


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    # Tensor parallelism: this rank's slice of the intermediate dimension; the down
    # projection's partial sums are all-reduced (models/tensor_parallel.py).
    tp: Optional[ParallelGroup] = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        if config.hidden_act not in ops.ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {config.hidden_act!r}")
        self.hidden_act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(ops.act_and_mul(self.gate_up_proj(x), self.hidden_act))
        return y if self.tp is None else self.tp.all_reduce(y)


class LlamaAttention(nn.Module):
    tp: Optional[ParallelGroup] = None  # this rank's heads; o_proj's partial sums all-reduced
    softcap: Optional[float] = None  # attention logit softcap (none in this family)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window if config.is_sliding(layer_idx) else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: LayerKV, output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T, hidden] -> the attention block's output for ``output_rows`` of them (None: all)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        self.norm_and_rope_(qkv, cos, sin)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window)
        y = output_projection(self.o_proj, out.reshape(n, -1), output_rows)
        return y if self.tp is None else self.tp.all_reduce(y)

    def norm_and_rope_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding of q and k, in place (QK-norm architectures norm them first)."""
        ops.rope_qk_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)


class LlamaDecoderLayer(nn.Module):
    attention_class: type[nn.Module] = LlamaAttention  # (Qwen3: with QK-norm; DeepSeek: MLA)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.build_mlp(config, layer_idx)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The layer's MLP (Qwen3-MoE: routed experts on most layers)."""
        return GatedMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: LayerKV, output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's output for ``output_rows`` of the step (None: every row)."""
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, attn_metadata, kv_cache, output_rows)
        if output_rows is not None:
            hidden = hidden.index_select(0, output_rows)
        hidden = hidden + attn
        with roles_of_rows(output_rows):
            return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer  # (an architecture's own layer)
    # Pipeline parallelism: ``layers`` are this stage's; the hidden states come from the
    # previous stage instead of the embedding, and go to the next one.
    pp: Optional[PipelineStage] = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_inv_freq = RopeFrequencies(self.rotary_dim(config), config.rope_theta, config.rope_scaling,
                                             config.max_position_embeddings)
        self.fused_layers: Optional[FusedDecoderLayers] = None  # kvserve.models.fused attaches it

    @staticmethod
    def rotary_dim(config: ModelConfig) -> int:
        """The dims rope rotates: the whole head (DeepSeek's MLA: its rope part only)."""
        return config.head_dim

    def fused_inputs(self, num_positions: int, device: torch.device) -> tuple:
        """What the fused layers read besides the step: (the embedding table's arguments
        (kvserve.row_table.table_args), its scale, rope tables covering ``num_positions``, for
        global and local layers alike)."""
        tables = self.rope_inv_freq.tables(num_positions, device)
        return table_args(self.embed_tokens), 1.0, tables, tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_caches: KVCache, output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The hidden states of ``output_rows`` of the step (sorted, distinct; None: every row)
        before the final norm (a stage before the last is given None: every row goes on)."""
        fused = self.fused_layers
        if fused is not None and fused.applies_to(self.embed_tokens, kv_caches):
            return fused(input_ids, positions, *self.fused_inputs(attn_metadata.max_seq_len, input_ids.device),
                         attn_metadata, kv_caches, output_rows)
        if self.pp is None or self.pp.is_first:
            hidden = self.embed_tokens(input_ids)
        else:
            hidden = self.pp.recv(input_ids.shape[0], self.config.hidden_size, self.norm.weight.dtype,
                                  input_ids.device)
        # Rope rows for this step's positions only, shared by all layers.
        cos, sin = self.rope_inv_freq.cos_sin(positions, hidden.dtype, attn_metadata.max_seq_len)
        last = len(self.layers) - 1  # (output_rows: None on a stage before the last)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, cos, sin, attn_metadata, kv_cache, output_rows if i == last else None)
        if self.pp is not None and not self.pp.is_last:
            self.pp.send(hidden)
        return hidden  # pre-norm: the caller norms only the rows it needs logits for


class LlamaForCausalLM(PagedCausalLM):
    model_class: type[LlamaModel] = LlamaModel  # (an architecture's own decoder)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()


def tiny_config() -> ModelConfig:
    """tiny-llama: a random-weight test model on SmolLM2's vocabulary (its tokenizer drives
    it; bos 1, eos 2)."""
    return ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=[2], name="tiny-llama",
    )


# GGUF (models/gguf_layout.py): llama.cpp permutes llama's q/k rows for its rope; qwen2's
# (NEOX rope) are HF's.
GGUF_LAYOUTS = (
    GGUFLayout("llama", "llama", LLAMA_BLOCK_NAMES, permuted_qk=True),
    GGUFLayout("qwen2", "qwen2", LLAMA_BLOCK_NAMES),
)
