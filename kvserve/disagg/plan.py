"""Which KV blocks of a request move, and where each lands. Torch-free.

A request's KV is one block table per KV cache group (kv_manager.py). After its prompt, a
prefill instance holds every block of a full-attention group and, in a sliding-window group,
the blocks a query at the prompt's end can still see: those are what it publishes
(``published_blocks``), group by group, as the rows of one payload. A decode instance with a
prefix-cache hit of ``k`` blocks needs only the entries past the hit (``needed_blocks``); the
rows those are stored in come in a few runs of consecutive rows (``row_runs``), which is what
a connector reads.
"""
from __future__ import annotations

from typing import Optional, Sequence

from kvserve.kv_manager import first_visible_block

BlockRef = tuple[int, int]  # (KV cache group, index in the group's block table)


class KVTransferError(RuntimeError):
    """A transfer that cannot complete (producer gone, data expired or malformed). The decode
    side re-prefills the request locally."""


def published_blocks(group_windows: Sequence[Optional[int]], block_size: int,
                     num_prompt_tokens: int) -> list[BlockRef]:
    """The entries a prefill instance publishes for a prompt of ``num_prompt_tokens`` tokens:
    those a query at the prompt's last full-block boundary or later sees. The decode query (at
    ``num_prompt_tokens``) needs fewer in a sliding group, but with these the decode side's
    prefix cache can serve the whole prompt again, as the prefill side's can."""
    num_blocks = -(-num_prompt_tokens // block_size)
    boundary = num_prompt_tokens // block_size * block_size
    return [(g, i) for g, window in enumerate(group_windows)
            for i in range(first_visible_block(window, block_size, boundary), num_blocks)]


def needed_blocks(group_windows: Sequence[Optional[int]], block_size: int, num_prompt_tokens: int,
                  num_hit_blocks: int) -> list[BlockRef]:
    """The published entries a decode instance lacks when its prefix cache already holds the
    first ``num_hit_blocks`` blocks of every group (as far as each group keeps them)."""
    return [(g, i) for g, i in published_blocks(group_windows, block_size, num_prompt_tokens)
            if i >= num_hit_blocks]


def rows_of(published: Sequence[BlockRef], wanted: Sequence[BlockRef]) -> list[int]:
    """The payload row of each wanted entry; KVTransferError if one was not published."""
    row = {entry: r for r, entry in enumerate(published)}
    missing = [e for e in wanted if e not in row]
    if missing:
        raise KVTransferError(f"blocks {missing[:4]} were not published by the prefill instance")
    return [row[e] for e in wanted]


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``rows`` as (first row, count) runs of consecutive rows, in order."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs
