"""Multi-head latent attention (MLA), DeepSeek V2/V3's attention layer, on the latent cache.

Projections (HF's names and shapes): the query either from one ``q_proj`` (``q_lora_rank``
None, V2-Lite) or through a low-rank bottleneck ``q_b_proj(q_a_layernorm(q_a_proj(x)))``
(V2/V3), each head's ``qk_nope_head_dim`` + ``qk_rope_head_dim`` wide; ``kv_a_proj_with_mqa``
gives the token's latent (``kv_lora_rank``, then ``kv_a_layernorm``) and its rope key (one for
all heads, like MQA); ``kv_b_proj`` maps the latent to each head's key nope part and value;
``o_proj`` maps the heads' values back. The cache keeps the latent and the rotated rope key
only (kvserve/kv_cache.py); kvserve/latent_attention.py attends over them (absorbed decode,
expanded prefill).

Rope rotates only the rope dims, in DeepSeek's layout: adjacent pairs ``(x0, x1), (x2, x3)``
(HF's V2 complex rotation and V3's ``rope_interleave``; the output is de-interleaved, as V3's,
which V2's interleaved output equals up to a permutation that queries and keys share, so
their scores are the same), or halves (``rope_interleave`` False). With YaRN, cos/sin carry
its attention factor (models/layers.py) and the softmax scale ``mscale(factor,
mscale_all_dim)^2``, as HF's ``yarn_apply_mscale``.

Tensor parallelism: each rank holds ``1/T`` of the heads, that is, its rows of ``q_proj`` /
``q_b_proj`` and ``kv_b_proj`` and its columns of ``o_proj`` (all-reduced once, as LLaMA's);
``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms are replicated, and so is the latent
cache: the latent is every head's key and value at once (MQA-like), so splitting it across
ranks would need the partial scores of every head summed across ranks before each softmax;
replicated, a rank's heads attend on their own and the only collective is o_proj's.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.attention import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.distributed import ParallelGroup
from kvserve.kv_cache import LatentLayerKV
from kvserve.latent_attention import paged_latent_attention
from kvserve.models.layers import RMSNorm, output_projection, yarn_mscale
from kvserve.quant import Fp32Linear
from kvserve.quant.common import batch_invariant_linears

# HF's DeepseekV2/V3 build q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon,
# not the config's rms_norm_eps (DeepSeek's own code does the same).
LATENT_NORM_EPS = 1e-6


def rotate_rope_dims(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x [T, heads, d]`` rotated by ``cos``/``sin`` ``[T, d]`` (models/layers.py's tables: each
    frequency's angle in both halves). ``interleaved``: dims (2i, 2i+1) rotate together, the
    output holding the rotated even dims then the odd ones (HF's V3 interleave)."""
    half = x.shape[-1] // 2
    if interleaved:
        c, s = cos[:, None, :half], sin[:, None, :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)
    c, s = cos[:, None], sin[:, None]
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated_half * s


def mla_softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared where the
    rope scaling names one (HF's ``yarn_apply_mscale``: DeepSeek scales the non-rope dims'
    scores too)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def _invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``, through kvserve's batch-invariant fp32 kernel where it applies (a
    row's result then does not depend on the rows beside it)."""
    if (weight.dtype == x.dtype == torch.float32 and x.device.type == "cpu" and ops.cpu_extension() is not None
            and batch_invariant_linears()):
        return Fp32Linear(weight, None)(x)
    return nn.functional.linear(x, weight)


class KVUpProjection(nn.Module):
    """``kv_b_proj``: ``weight [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``, head h's
    rows its key half ``W_UK[h]`` then its value half ``W_UV[h]``. Not an ``nn.Linear``: the
    absorbed decode multiplies by each head's halves apart, so weight-format conversion
    leaves it in the activations' dtype."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = config.num_attention_heads, config.kv_lora_rank
        self.qk_nope_head_dim, self.v_head_dim = config.qk_nope_head_dim, config.v_head_dim
        self.weight = nn.Parameter(
            torch.empty(self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            requires_grad=False)

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        key_half = self._per_head()[:, :self.qk_nope_head_dim]  # [H, nope, rank]
        return torch.matmul(q_nope.transpose(0, 1), key_half.to(q_nope.dtype)).transpose(0, 1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = _invariant_linear(latent, self.weight.to(latent.dtype))
        kv = kv.view(latent.shape[0], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv[..., :self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]

    def values_from_latent(self, latent_out: torch.Tensor) -> torch.Tensor:
        value_half = self._per_head()[:, self.qk_nope_head_dim:]  # [H, v, rank]
        out = torch.matmul(latent_out.transpose(0, 1), value_half.transpose(1, 2).to(latent_out.dtype))
        return out.transpose(0, 1)


class MultiHeadLatentAttention(nn.Module):
    tp: Optional[ParallelGroup] = None  # this rank's heads; o_proj's partial sums all-reduced

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        q_width = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(config)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
        self.rope_interleave = config.rope_interleave
        self.scale = mla_softmax_scale(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: LatentLayerKV, output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T, hidden] -> the attention block's output for ``output_rows`` of them (None: all)."""
        n = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(n, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, rope_key = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope = rotate_rope_dims(q_rope, cos, sin, self.rope_interleave)
        rope_key = rotate_rope_dims(rope_key[:, None], cos, sin, self.rope_interleave)[:, 0]
        out = paged_latent_attention(q_nope, q_rope, latent, rope_key, kv_cache, attn_metadata, self.scale,
                                     self.kv_b_proj)
        y = output_projection(self.o_proj, out.reshape(n, -1), output_rows)
        return y if self.tp is None else self.tp.all_reduce(y)
