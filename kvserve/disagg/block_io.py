"""Copying whole KV blocks between the cache tensors and transfer rows.

A row is one block id's KV in every layer slot of the cache (kv_cache.py: a block id is one
block of each slot tensor, whichever group's table holds it): for each slot in order, the
block's data ``[2, kv heads, block_size, head_dim]`` as stored (keys transposed, int8 pairs
interleaved: the bytes are copied, never reinterpreted) and, for an int8 cache, its fp16
scales ``[2, kv heads, scale groups, block_size]``. Rows are ``KVCacheSpec.bytes_per_block``
bytes, the same on both sides when their ``layout_id`` agrees.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

from kvserve.kv_cache import KVCache, KVCacheSpec


def layout_id(spec: KVCacheSpec) -> str:
    """A name of everything that fixes a row's bytes and a group's meaning: two caches may
    exchange blocks only when theirs are equal."""
    groups = ";".join(f"{g.window}:{','.join(map(str, g.layers))}" for g in spec.groups)
    digest = hashlib.sha256(groups.encode()).hexdigest()[:12]
    return (f"kv1-{spec.dtype}-L{spec.num_layers}-H{spec.num_kv_heads}-D{spec.head_dim}-B{spec.block_size}"
            f"-G{spec.num_groups}x{spec.slots_per_group}-{digest}")


def _slot_tensors(cache: KVCache) -> list[list[torch.Tensor]]:
    """Per slot, the tensors a row holds, in row order: data, then scales for int8."""
    spec = cache.spec
    slots: dict[int, list[torch.Tensor]] = {}
    for layer in spec.layer_ids:
        slot = spec.slot_of(layer)
        if slot not in slots:
            kv = cache[layer - spec.first_layer]
            slots[slot] = [kv.data] + ([kv.scales] if kv.scales is not None else [])
    return [slots[s] for s in sorted(slots)]


def _row_parts(cache: KVCache, rows: torch.Tensor):
    """(cache tensor, its [n, *block shape] view into ``rows``) for each part of a row."""
    offset = 0
    for tensors in _slot_tensors(cache):
        for t in tensors:
            block_shape = (t.shape[0], t.shape[1], *t.shape[3:])
            size = t.element_size() * int(np.prod(block_shape))
            part = rows[:, offset:offset + size].view(t.dtype).view(rows.shape[0], *block_shape)
            yield t, part
            offset += size
    if offset != rows.shape[1]:
        raise ValueError(f"transfer rows of {rows.shape[1]} bytes for a cache whose blocks hold {offset}")


def gather_blocks(cache: KVCache, block_ids: Sequence[int], out: np.ndarray) -> None:
    """Copy blocks ``block_ids`` into ``out`` ([len(block_ids), bytes_per_block] uint8)."""
    if not len(block_ids):
        return
    ids = torch.tensor(block_ids, dtype=torch.long)
    rows = torch.from_numpy(out)
    for t, part in _row_parts(cache, rows):
        part.copy_(t.index_select(2, ids).movedim(2, 0))


def scatter_blocks(cache: KVCache, block_ids: Sequence[int], rows: np.ndarray) -> None:
    """Copy ``rows`` ([len(block_ids), bytes_per_block] uint8) into blocks ``block_ids``."""
    if not len(block_ids):
        return
    ids = torch.tensor(block_ids, dtype=torch.long)
    src = torch.from_numpy(rows)
    for t, part in _row_parts(cache, src):
        t.index_copy_(2, ids, part.movedim(0, 2))
