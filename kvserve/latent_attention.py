"""Paged multi-head latent attention (MLA, DeepSeek V2/V3) over the latent cache.

Per token the cache holds one entry for every head (``kvserve.kv_cache.LatentLayerKV``): the
compressed latent ``c`` (after ``kv_a_layernorm``) and the rotated rope key ``k_r``. Head h's
key is ``[W_UK[h] c, k_r]`` and its value ``W_UV[h] c``, with ``W_UK``/``W_UV`` the key and
value halves of ``kv_b_proj``. Attention never stores those; it reads the entries and:

- decodes (one query of a sequence) in the *absorbed* form: the query's nope part is taken
  into latent space once, ``q_c = W_UK[h]^T q_nope`` (``kv_lora_rank`` wide), so that a score
  is ``q_c . c + q_r . k_r`` straight over the cached entries, the weighted sum of the latents
  ``o_c = sum_t p_t c_t`` is taken, and only it goes through ``W_UV[h]``. Per step the work
  on the cache is (kv_lora_rank + rope) per head and token, and nothing per-head is built
  from the context: decode reads the latent cache as it is.
- prefills (a chunk of several queries) in the *expanded* form: the context's latents go
  through ``kv_b_proj`` to per-head keys and values once for the chunk's many queries, and a
  causal SDPA runs on them (cheaper than absorbing when queries are many; the per-head K/V
  live only for the call).

The two forms are equal up to rounding. This is a torch implementation (the native fused
decoder declines MLA layers, models/spec.py); one profiler label (``latent attention``)
covers it, cache write included.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve.attention import AttentionMetadata, DecodePlan, decode_plans
from kvserve.kv_cache import LatentLayerKV
from kvserve.tracing import label


class LatentUpProjection(Protocol):
    """What attention needs of a layer's ``kv_b_proj`` (models/mla.py's KVUpProjection)."""

    v_head_dim: int

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``[n, H, qk_nope_head_dim]`` -> ``[n, H, kv_lora_rank]``: each head's ``W_UK[h]^T q``."""

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[L, kv_lora_rank]`` -> (keys' nope parts ``[L, H, qk_nope_head_dim]``, values
        ``[L, H, v_head_dim]``)."""

    def values_from_latent(self, latent_out: torch.Tensor) -> torch.Tensor:
        """``[n, H, kv_lora_rank]`` -> ``[n, H, v_head_dim]``: each head's ``W_UV[h] o``."""


def paged_latent_attention(
    q_nope: torch.Tensor,  # [T, H, qk_nope_head_dim]
    q_rope: torch.Tensor,  # [T, H, qk_rope_head_dim], rotated
    latent: torch.Tensor,  # [T, kv_lora_rank], normed: this step's cache entries
    rope_key: torch.Tensor,  # [T, qk_rope_head_dim], rotated
    kv: LatentLayerKV,
    attn_metadata: AttentionMetadata,
    scale: float,
    up: LatentUpProjection,
) -> torch.Tensor:
    """``[T, H, v_head_dim]``: writes the step's entries at ``slot_mapping``, then each
    sequence's queries (positions ``context_len .. seq_len - 1``) attend causally over its
    cached entries ``0 .. seq_len - 1``."""
    with label("latent attention"):
        md = attn_metadata.for_group(kv.group)
        kv.write(latent, rope_key, md.slot_mapping)
        plans = decode_plans(md, None)
        if len(plans) == 1 and plans[0].rows is None:  # every row a decode, in order
            return _absorbed_decode(q_nope, q_rope, kv, plans[0], scale, up)
        num_rows, num_heads = q_nope.shape[:2]
        out = q_nope.new_empty(num_rows, num_heads, up.v_head_dim)
        for plan in plans:
            out.index_copy_(0, plan.rows, _absorbed_decode(q_nope.index_select(0, plan.rows),
                                                           q_rope.index_select(0, plan.rows), kv, plan, scale, up))
        qsl = md.query_start_loc
        for seq, n in enumerate(md.query_lens):
            if n > 1:
                a, b = qsl[seq], qsl[seq + 1]
                out[a:b] = _expanded_prefill(q_nope[a:b], q_rope[a:b], kv, md, seq, scale, up)
        return out


def _absorbed_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: LatentLayerKV, plan: DecodePlan,
                     scale: float, up: LatentUpProjection) -> torch.Tensor:
    """One query per sequence, every head scored against the latent entries directly."""
    num_seqs = q_nope.shape[0]
    rank = kv.latent.kv_lora_rank
    # Every sequence's visible blocks, padded to the longest: [S, L, rank + rope].
    entries = kv.gather(plan.block_ids, q_nope.dtype).view(num_seqs, -1, kv.latent.width)
    query = torch.cat((up.absorb_query(q_nope), q_rope), dim=-1)  # [S, H, rank + rope]
    scores = torch.matmul(query, entries.transpose(1, 2)).float() * scale  # [S, H, L]
    probs = (scores + plan.key_bias).softmax(dim=-1).to(entries.dtype)  # (key_bias [S, 1, L]: padding)
    latent_out = torch.matmul(probs, entries[..., :rank])  # [S, H, rank]
    return up.values_from_latent(latent_out)


def _expanded_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: LatentLayerKV, md: AttentionMetadata,
                      seq: int, scale: float, up: LatentUpProjection) -> torch.Tensor:
    """One sequence's chunk of queries over its whole context, the latents expanded to
    per-head keys and values. The context is read back from the cache (this chunk's entries
    included), so every query sees exactly what later steps will see (an int8 cache's
    rounding too)."""
    context, seq_len = md.context_lens[seq], md.seq_lens[seq]
    num_heads = q_nope.shape[1]
    rank = kv.latent.kv_lora_rank
    block_ids = md.block_tables[seq, :(seq_len - 1) // md.block_size + 1].long()
    entries = kv.gather(block_ids, q_nope.dtype)[:seq_len]  # [L, rank + rope]
    k_nope, values = up.expand(entries[:, :rank])  # [L, H, nope], [L, H, v]
    rope_key = entries[:, None, rank:].expand(-1, num_heads, -1)
    keys = torch.cat((k_nope, rope_key), dim=-1)
    queries = torch.cat((q_nope, q_rope), dim=-1)
    mask = None
    if context:
        # Causal over positions, never a materialised tril(ones).
        q_pos = torch.arange(context, seq_len, device=q_nope.device)[:, None]
        mask = torch.arange(seq_len, device=q_nope.device)[None, :] <= q_pos
    v_head_dim = values.shape[-1]
    if v_head_dim != keys.shape[-1]:
        # Values zero-padded to the keys' width: SDPA's fused CPU kernel takes one head width
        # (with two it falls back to the math path, which builds the causal mask as a
        # tril(ones(n, n))); the padding's outputs are zeros, cut off below.
        values = F.pad(values, (0, keys.shape[-1] - v_head_dim))
    out = F.scaled_dot_product_attention(queries.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, is_causal=context == 0,
                                         scale=scale)
    return out[0, ..., :v_head_dim].transpose(0, 1)
