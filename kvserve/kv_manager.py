"""Per-request view of the KV cache: prefix-cache lookup, slot allocation, freeing.

Torch-free. A request's KV lives in a list of fixed-size blocks (its block table). Full
blocks are identified by a chained hash of their tokens, so requests that share a prompt
prefix share the blocks holding it, and a finished request's blocks stay findable until
the pool needs them back.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

from kvserve.block_pool import Block, BlockHash, BlockPool
from kvserve.request import Request


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: Sequence[int]) -> BlockHash:
    """Stable hash of a full block, chained on the hash of the block before it."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._req_blocks: dict[str, list[Block]] = {}
        # Per request: how many leading blocks of its table have been offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Token counts, like vLLM: prompt (and recomputed) tokens looked up, and those found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    # ---- prefix cache --------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of ``request``'s full blocks: (block ids, tokens covered).

        The last token is never served from the cache: computing it is what yields the
        logits to sample from. Pass the result straight to ``allocate_slots``: the blocks
        are not referenced until then and any allocation in between may evict them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        if (request.prompt_logprobs is not None
                and len(request.prompt_logprobs) < request.num_prompt_tokens - 1):
            return [], 0  # a cached token's logits are never computed: its logprob would be lost
        num_tokens = request.num_tokens
        max_hit_blocks = (num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        hits: list[Block] = []
        parent: Optional[Block] = None
        for i in range(max_hit_blocks):
            block = self.block_pool.get_cached_block(request.block_hashes[i])
            if block is None or not block.holds(self._block_tokens(request, i), parent):
                break
            hits.append(block)
            parent = block
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return [b.block_id for b in hits], num_hit_tokens

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
        lookahead: int = 0,
    ) -> Optional[list[int]]:
        """Give ``request`` blocks for all tokens it will hold after this step.

        That is ``num_computed_tokens + num_new_computed_tokens + num_new_tokens + lookahead``
        tokens, where the prefix-hit blocks ``new_computed_block_ids`` cover the
        ``num_new_computed_tokens`` tokens after ``num_computed_tokens``. Returns the whole
        block table, or None (changing nothing) when the pool cannot supply the blocks.
        """
        blocks = self._req_blocks.get(request.request_id, [])
        hit_blocks = [self.block_pool.blocks[i] for i in new_computed_block_ids]
        num_known_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = self.num_blocks_for(num_known_tokens + lookahead)
        num_new_blocks = max(0, num_required - len(blocks) - len(hit_blocks))
        # Hit blocks sitting in the free queue are taken out of it by ``touch``.
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None

        self.block_pool.touch(hit_blocks)
        blocks.extend(hit_blocks)
        blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))
        self._req_blocks[request.request_id] = blocks
        if self.enable_prefix_caching:
            # Blocks whose every token is computed by the end of this step become findable now,
            # so a request scheduled later in the same step may hit them: the runner must write
            # a layer's new K/V for the whole batch before any attention reads the cache.
            self._cache_full_blocks(request, blocks, min(num_known_tokens, request.num_tokens) // self.block_size)
        return [b.block_id for b in blocks]

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the tail blocks beyond the first ``num_tokens`` tokens (rejected
        speculative drafts' lookahead). Those blocks were never hashed: only tokens the
        request holds are, and drafts are not among them until accepted."""
        blocks = self._req_blocks.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        assert self._num_cached_blocks.get(request.request_id, 0) <= keep
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        """Return every block of ``request`` at once; cached ones stay findable until evicted."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        # Tail first: a sequence's last blocks are the least likely to be shared, evict them first.
        self.block_pool.free_blocks(reversed(blocks))

    # ---- internals -----------------------------------------------------------------------

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_full: int) -> None:
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        self.block_pool.cache_full_blocks(
            blocks[start:num_full],
            request.block_hashes[start:num_full],
            [self._block_tokens(request, i) for i in range(start, num_full)],
            parent=blocks[start - 1] if start > 0 else None,
        )
        self._num_cached_blocks[request.request_id] = num_full

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, self._block_tokens(request, i)))

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        """Token ids of full block ``index`` without concatenating prompt and output."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        prompt, num_prompt = request.prompt_token_ids, request.num_prompt_tokens
        if end <= num_prompt:
            return tuple(prompt[start:end])
        output = request.output_token_ids
        if start >= num_prompt:
            return tuple(output[start - num_prompt:end - num_prompt])
        return tuple(prompt[start:]) + tuple(output[:end - num_prompt])
