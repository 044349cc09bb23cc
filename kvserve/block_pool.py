"""The physical KV blocks as pure bookkeeping: ref counts, an LRU free queue, a hash index.

Torch-free. A block is only an id here; the runner owns the tensors the ids point into.

With ``reserve_null_block`` block 0 is never handed out: it is the zero-filled block that a
sliding-window group's table points at for positions no query can see any more (kernels may
still read it and mask it; it must hold finite values, unlike a freed block reused by another
request).

A block with ``ref_cnt == 0`` sits in the free queue. If it still carries a hash (it holds
the KV of a full, cached block) it stays findable through the hash index until it is
handed out again, which evicts it. Allocation takes from the head of the queue and freeing
appends to the tail, so the cached blocks freed longest ago are the first to be evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

BlockHash = bytes


class Anchor(Protocol):
    """What a cached block's KV is verified against (``Block.holds``): the block before it, or
    for a sliding-window group's block an anchor at its own position (the full group's block
    there, or the prefix's ``prefix_index.PrefixNode`` when no group is full)."""

    @property
    def generation(self) -> int: ...


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Bumped every time the block is handed out: a child cached against an older
    # generation of its parent describes KV computed over content that is gone.
    generation: int = 0
    # Set only while the block is in the hash index (a cached full block).
    block_hash: Optional[BlockHash] = None
    token_ids: Optional[tuple[int, ...]] = None
    parent: Optional[Anchor] = None
    parent_generation: int = 0

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    def holds(self, token_ids: tuple[int, ...], parent: Optional[Anchor]) -> bool:
        """True when this cached block's KV is exactly ``token_ids`` following ``parent``'s.

        Compares tokens and the parent's identity rather than trusting the hash, so a hash
        collision can never serve wrong KV. ``parent`` must itself have been verified.
        """
        if self.token_ids != token_ids or self.parent is not parent:
            return False
        return parent is None or self.parent_generation == parent.generation

    def _drop_cache_entry(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.parent = None
        self.parent_generation = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block: Optional[Block] = None
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1  # held forever: never freed, never handed out
        # Ordered by block id: the OrderedDict gives O(1) pop-head, append-tail and removal
        # from the middle (a cache hit on a free block).
        self._free_queue: OrderedDict[int, Block] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null_block)
        self._cached: dict[BlockHash, Block] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, including evictable cached ones."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue (evicting cached ones), ref 1."""
        if n > len(self._free_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.generation += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on each block, pulling free (cached) ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop a reference on each block; blocks reaching 0 go to the tail of the free queue.

        The order given is the eviction order among them: callers pass a sequence's blocks
        tail first, so a shared prefix outlives the suffixes that hang off it.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def get_cached_block(self, block_hash: BlockHash) -> Optional[Block]:
        """The cached block indexed under ``block_hash``; the caller verifies it with ``holds``."""
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        block_token_ids: Sequence[tuple[int, ...]],
        parent: Optional[Block],
        anchors: Optional[Sequence[Anchor]] = None,
    ) -> None:
        """Index a run of consecutive full blocks of one sequence; ``parent`` precedes the first.

        With ``anchors`` (a sliding-window group, whose earlier blocks may be gone), each block
        is verified against its anchor instead of the block before it: the block at the same
        position in the full group, itself verified through the full chain, or where no group
        is full the prefix node of that position (prefix_index.py).

        A hash already indexed (the same content computed twice, or a collision) keeps its
        first block; the newcomer simply stays uncached.
        """
        if not self.enable_caching:
            return
        for i, (block, block_hash, token_ids) in enumerate(zip(blocks, block_hashes, block_token_ids, strict=True)):
            if anchors is not None:
                parent = anchors[i]
            if block.block_hash is None and block_hash not in self._cached and block is not self.null_block:
                block.block_hash = block_hash
                block.token_ids = token_ids
                block.parent = parent
                block.parent_generation = parent.generation if parent is not None else 0
                self._cached[block_hash] = block
            parent = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their KV stays where it is, it just can't be hit)."""
        for block in self._cached.values():
            block._drop_cache_entry()
        self._cached.clear()

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block._drop_cache_entry()
