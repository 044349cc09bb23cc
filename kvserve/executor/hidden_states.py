"""A prompt's final-norm hidden states (for pooling: /v1/embeddings), computed by the model's
own forward over the prompt, chunk by chunk, without generating.

The KV the forward writes goes into a cache of its own, sized for this one prompt and dropped
when the call returns, rather than into blocks of the engine's pool: every block of the pool
belongs to the scheduler's KV manager (counted, handed out, keyed for the prefix cache), and
a request that borrowed some between steps would have to pass through all of that bookkeeping
for KV no later step reads. A scratch cache costs a prompt's KV for the length of the call (a
512-token SmolLM2 prompt: 12 MiB in bf16) and leaves the pool, its counts and the prefix cache
exactly as they were.
"""
from __future__ import annotations

import torch

from kvserve.attention import build_attention_metadata
from kvserve.kv_cache import KVCache, KVCacheSpec
from kvserve.token_roles import ALL_PROMPT, TokenRoles


@torch.inference_mode()
def prompt_hidden_states(model: torch.nn.Module, kv_spec: KVCacheSpec, token_ids: list[int],
                         device: torch.device, chunk_size: int,
                         wants_token_roles: bool = False) -> torch.Tensor:
    """[len(token_ids), hidden] float32: the hidden state after the final norm at every
    position, each position attending to the ones before it (causal), as in a prefill.
    ``chunk_size``: tokens per forward call (the engine's per-step budget), so a long prompt
    needs no more activation memory than a step does. ``wants_token_roles``: the model's
    linears compute prompt rows in their prefill format (int4 mode); every row here is one."""
    if not token_ids:
        raise ValueError("no tokens")
    block_size = kv_spec.block_size
    num_blocks = -(-len(token_ids) // block_size)
    # A block id is one block in each of a group's layer slots, and the groups share the slot
    # tensors (kv_cache.py): each group gets blocks of its own, as the pool would give them
    # (else a later group's layers overwrite an earlier one's keys before the next chunk reads
    # them). Block 0 stays the zero block a sliding group's released entries point at; nothing
    # is released here, so every group keeps the whole prompt.
    kv = KVCache.allocate(kv_spec, 1 + kv_spec.num_groups * num_blocks, device)
    tables = [list(range(1 + g * num_blocks, 1 + (g + 1) * num_blocks)) for g in range(kv_spec.num_groups)]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    roles = TokenRoles(ALL_PROMPT) if wants_token_roles else None
    rows = []
    for start in range(0, len(token_ids), chunk_size):
        end = min(len(token_ids), start + chunk_size)
        metadata = build_attention_metadata([tables[0]], [start], [end - start], block_size, device,
                                            group_block_tables=[[table] for table in tables[1:]])
        positions = torch.arange(start, end, dtype=torch.int64, device=device)
        rows.append(model.hidden_states(ids[start:end], positions, metadata, kv, roles).float())
    return torch.cat(rows)
