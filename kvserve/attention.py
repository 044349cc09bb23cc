"""Paged attention: per-step metadata and the backends that read/write the paged KV cache.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). Token ``i`` of a sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    """Built by the runner once per step and passed down to every attention layer.

    Sequences are flattened: query tokens of sequence ``s`` are rows
    ``query_start_loc[s]:query_start_loc[s+1]`` of the step's ``[T, ...]`` tensors.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_start_loc: list[int]  # [S+1] python ints
    context_lens: list[int]  # [S] tokens already in the cache before this step
    seq_lens: list[int]  # [S] context_lens + query lens: tokens attended after this step
    block_size: int
    # Device copies, for vectorised backends.
    seq_lens_tensor: Optional[torch.Tensor] = None  # [S] int32
    query_start_loc_tensor: Optional[torch.Tensor] = None  # [S+1] int32

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_all_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @property
    def query_lens(self) -> list[int]:
        qsl = self.query_start_loc
        return [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
