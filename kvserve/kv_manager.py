"""Per-request view of the KV cache: prefix-cache lookup, slot allocation, freeing.

Torch-free. A request's KV lives in a list of fixed-size blocks (its block table). Full
blocks are identified by a chained hash of their tokens, so requests that share a prompt
prefix share the blocks holding it, and a finished request's blocks stay findable until
the pool needs them back.

KV cache groups (``kvserve.kv_cache.KVCacheGroup``): a request has one block table per group,
all drawing on one pool. Full-attention groups come first and keep every block, as a model
with one group always did. A sliding-window group of window W keeps only the blocks a query
can still see: once the next query is at position p, keys before ``p - W + 1`` are invisible
to every future query, so the blocks wholly before that go back to the pool (they stay in the
hash index while free) and their table entries point at the pool's null block. A group's
cached blocks are indexed under the chain hash tagged with the group. Every group may be
sliding (Mistral: one window on every layer).

Prefix-cache rule for sliding groups (vLLM's): a hit of h tokens needs, in a full group, the
whole chain ``[0, h)`` and, in each sliding group, the blocks holding keys a query at h can
see, ``[h - W + 1, h)``; the hit is the largest block multiple h, at most the longest
verified prefix, where every group has them, found by searching down from the right: a block
missing at i caps h at i's start. Verification (tokens and identity, never the hash alone):
group 0's blocks, when it is full, each through the block before it, the whole chain; every
other group's cached block against an *anchor* at its own position, itself verified through
the whole prefix, so a block whose predecessors were evicted can still be hit and a hash
collision can no more serve wrong KV than before. The anchor is group 0's block at that
position, or, when no group is full, the prefix's node in a trie of token blocks kept apart
from any KV (``kvserve.prefix_index``, which says why and what it costs).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

from kvserve.block_pool import Anchor, Block, BlockHash, BlockPool
from kvserve.prefix_index import PrefixIndex, PrefixNode
from kvserve.request import Request


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: Sequence[int],
                      num_prompt_tokens: Optional[int] = None) -> BlockHash:
    """Stable hash of a full block, chained on the hash of the block before it.

    ``num_prompt_tokens``: how many of the block's tokens are prompt tokens, for a block that
    holds generated ones too, when the KV depends on the roles (see ``KVCacheManager``); None
    for a block of prompt tokens only, hashed as ever."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    if num_prompt_tokens is not None:
        digest.update(b"prompt-end" + num_prompt_tokens.to_bytes(4, "little"))
    return digest.digest()


class KVCacheManager:
    """``hash_prompt_boundary``: the model computes a token's KV differently as a prompt token
    and as a generated one (int4 mode: bf16 prefill weights, 4-bit decode weights), so a block
    holding generated tokens is cached under where the prompt ends in it. Request B whose
    prompt is request A's prompt and output then shares A's prompt-only blocks, but not the
    blocks where A generated: their KV is not what B's own prompt computation gives."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: Sequence[Optional[int]] = (None,), hash_prompt_boundary: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.group_windows = list(group_windows)
        num_full = sum(1 for w in self.group_windows if w is None)
        if not self.group_windows or self.group_windows[:num_full] != [None] * num_full:
            raise ValueError(f"full-attention groups come first: group 0 must attend to everything (window "
                             f"None) unless every group is sliding, got {self.group_windows}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_prompt_boundary = hash_prompt_boundary
        has_sliding = any(w is not None for w in self.group_windows)
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, reserve_null_block=has_sliding)
        self._null = self.block_pool.null_block
        # Group 0 full: it verifies its own blocks and anchors the others. None full: the
        # prefix index anchors every group, and each request keeps the nodes of its cached blocks.
        self._prefix_index = PrefixIndex() if num_full == 0 else None
        self._anchored_groups = range(0 if num_full == 0 else 1, self.num_groups)
        self._req_nodes: dict[str, list[PrefixNode]] = {}
        # Per request, per group: its block table (a sliding group's released entries: null).
        self._req_blocks: dict[str, list[list[Block]]] = {}
        # Per request: how many leading blocks of its tables have been offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Token counts, like vLLM: prompt (and recomputed) tokens looked up, and those found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (all but the null block, when there is one)."""
        return self.block_pool.num_usable_blocks

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

    def max_blocks_for(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request holding up to ``num_tokens`` tokens of KV ever needs at
        once, over all groups, when a step computes at most ``max_chunk`` of its tokens."""
        return max_blocks_per_request(num_tokens, self.block_size, self.group_windows, max_chunk)

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        tables = self._req_blocks.get(request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        tables = self._req_blocks.get(request_id)
        return [[b.block_id for b in t] for t in tables] if tables else [[] for _ in self.group_windows]

    @property
    def num_prefix_nodes(self) -> int:
        """Live nodes of the prefix index (only when no group is full): those of the prefixes
        that cached blocks or running requests hold, none once both are gone."""
        return len(self._prefix_index) if self._prefix_index is not None else 0

    def num_held_blocks(self, request_id: str, group: int) -> int:
        """Real blocks (not the null block) in one group's table of the request."""
        tables = self._req_blocks.get(request_id)
        return sum(1 for b in tables[group] if b is not self._null) if tables else 0

    # ---- prefix cache --------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest cached prefix of ``request``'s full blocks: (block ids per group, tokens
        covered); a sliding group's list starts with null blocks where keys are out of sight.

        The last token is never served from the cache: computing it is what yields the
        logits to sample from. Pass the result straight to ``allocate_slots``: the blocks
        are not referenced until then and any allocation in between may evict them.
        """
        no_hit: list[list[int]] = [[] for _ in self.group_windows]
        if not self.enable_prefix_caching:
            return no_hit, 0
        if (request.prompt_logprobs is not None
                and len(request.prompt_logprobs) < request.num_prompt_tokens - 1):
            return no_hit, 0  # a cached token's logits are never computed: its logprob would be lost
        num_tokens = request.num_tokens
        max_hit_blocks = (num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks)
        anchors = self._verified_anchors(request, max_hit_blocks)
        num_hit, group_hits = self._anchored_hits(request, anchors)
        num_hit_tokens = num_hit * self.block_size
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        if self._prefix_index is not None:
            return group_hits, num_hit_tokens
        return [[b.block_id for b in anchors[:num_hit]]] + group_hits, num_hit_tokens

    def _verified_anchors(self, request: Request, max_blocks: int) -> list[Anchor]:
        """The anchors of the longest verified cached prefix of ``request``'s first
        ``max_blocks`` full blocks: group 0's cached blocks, each verified against the one
        before, or where no group is full the prefix index's nodes."""
        if self._prefix_index is not None:
            return self._prefix_index.verified_prefix(request.block_hashes[:max_blocks],
                                                      lambda i: self._block_tokens(request, i))
        hits: list[Anchor] = []
        parent: Optional[Block] = None
        for i in range(max_blocks):
            block = self.block_pool.get_cached_block(request.block_hashes[i])
            if block is None or not block.holds(self._block_tokens(request, i), parent):
                break
            hits.append(block)
            parent = block
        return hits

    def _anchored_hits(self, request: Request, anchors: list[Anchor]) -> tuple[int, list[list[int]]]:
        """The largest k <= len(anchors) such that every anchored group holds the cached blocks
        a query at ``k * block_size`` sees, each verified against the anchor at its position,
        and those groups' hit tables. Searched from the right (vLLM's SlidingWindowManager): a
        group missing block i caps k at i, and the groups are asked again at the lower k."""
        k = len(anchors)
        found: dict[tuple[int, int], Optional[Block]] = {}

        def cached(group: int, i: int) -> Optional[Block]:
            if (group, i) not in found:
                block = self.block_pool.get_cached_block(_group_key(group, request.block_hashes[i]))
                ok = block is not None and block.holds(self._block_tokens(request, i), anchors[i])
                found[group, i] = block if ok else None
            return found[group, i]

        changed = True
        while changed and k > 0:
            changed = False
            for g in self._anchored_groups:
                for i in range(k - 1, self._first_needed_block(g, k * self.block_size) - 1, -1):
                    if cached(g, i) is None:
                        k, changed = i, True  # a hit must end at or before the missing block
                        break
        tables = []
        for g in self._anchored_groups:
            first = self._first_needed_block(g, k * self.block_size) if k else 0
            tables.append([self._null.block_id] * first + [cached(g, i).block_id for i in range(first, k)])
        return k, tables

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: Sequence[Sequence[int]] = (),
        num_new_computed_tokens: int = 0,
        lookahead: int = 0,
    ) -> Optional[list[list[int]]]:
        """Give ``request`` blocks for all tokens it will hold after this step.

        That is ``num_computed_tokens + num_new_computed_tokens + num_new_tokens + lookahead``
        tokens, where the prefix-hit blocks ``new_computed_block_ids`` (per group, as
        ``get_computed_blocks`` returns them) cover the ``num_new_computed_tokens`` tokens after
        ``num_computed_tokens``. A sliding group first gives back the blocks no query of this
        step or later can see. Returns the whole block table of every group, or None (changing
        nothing) when the pool cannot supply the blocks.
        """
        num_groups = self.num_groups
        tables = self._req_blocks.get(request.request_id) or [[] for _ in range(num_groups)]
        hit_ids = list(new_computed_block_ids) or [[] for _ in range(num_groups)]
        hits = [[self.block_pool.blocks[i] for i in ids] for ids in hit_ids]
        num_known_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = self.num_blocks_for(num_known_tokens + lookahead)
        first_query = request.num_computed_tokens + num_new_computed_tokens

        num_new_blocks = [max(0, num_required - len(tables[g]) - len(hits[g])) for g in range(num_groups)]
        releases = [self._releasable(tables[g], g, first_query) for g in range(num_groups)]
        # Hit blocks sitting in the free queue are taken out of it by ``touch``; released blocks
        # nobody else holds join it.
        num_revived = sum(1 for group_hits in hits for b in group_hits if b.ref_cnt == 0)
        num_released = sum(1 for _, rel in releases for b in rel if b.ref_cnt == 1)
        if sum(num_new_blocks) + num_revived > self.block_pool.num_free_blocks + num_released:
            return None

        # Every group's releases, then every group's hits, then the new blocks: a hit sitting in
        # the free queue must be taken before any new block could evict it.
        for blocks, (end, released) in zip(tables, releases):
            if released:
                blocks[:end] = [self._null] * end
                self.block_pool.free_blocks(reversed(released))
        for blocks, group_hits in zip(tables, hits):
            self.block_pool.touch(b for b in group_hits if b is not self._null)
            blocks.extend(group_hits)
        for blocks, n in zip(tables, num_new_blocks):
            blocks.extend(self.block_pool.get_new_blocks(n))
        self._req_blocks[request.request_id] = tables
        if self.enable_prefix_caching:
            # Blocks whose every token is computed by the end of this step become findable now,
            # so a request scheduled later in the same step may hit them: the runner must write
            # a layer's new K/V for the whole batch before any attention reads the cache.
            self._cache_full_blocks(request, tables, min(num_known_tokens, request.num_tokens) // self.block_size)
        return [[b.block_id for b in blocks] for blocks in tables]

    def allocate_received(self, request: Request, hit_block_ids: Sequence[Sequence[int]],
                          num_hit_tokens: int, num_tokens: int
                          ) -> Optional[tuple[list[list[int]], list[tuple[int, int, int]]]]:
        """Blocks for a request whose first ``num_tokens`` tokens' KV is computed elsewhere (a
        prefill instance) and copied in: the prefix-cache hit (``get_computed_blocks``'s result,
        ``num_hit_tokens`` tokens) is kept, and every group gets a new block for each entry past
        the hit that a query at the last full-block boundary (``num_tokens`` rounded down) can
        see: the decode query at ``num_tokens`` needs less, but with these a later request with
        the same prompt can hit every full block, as it could where the prompt was computed. A
        sliding group's entries before that are the null block.

        Returns (the block table of every group, ``(group, index, block_id)`` of each new block
        to fill), or None (changing nothing) when the pool lacks room. The new blocks are not
        findable in the prefix cache until ``cache_received``: until their KV has arrived no
        other request may hit them."""
        if request.request_id in self._req_blocks:
            raise ValueError(f"request {request.request_id} already holds blocks")
        num_table = self.num_blocks_for(num_tokens)
        num_hit = num_hit_tokens // self.block_size
        hit_ids = list(hit_block_ids) or [[] for _ in self.group_windows]
        plan: list[list[Optional[Block]]] = []  # per group, per entry: a hit block, None = new, null
        num_new = num_revived = 0
        for g in range(self.num_groups):
            first = self._first_needed_block(g, num_tokens // self.block_size * self.block_size)
            entries: list[Optional[Block]] = []
            for i in range(num_table):
                if i < first:
                    entries.append(self._null)
                elif i < num_hit:
                    block = self.block_pool.blocks[hit_ids[g][i]]
                    num_revived += block.ref_cnt == 0
                    entries.append(block)
                else:
                    entries.append(None)
                    num_new += 1
            plan.append(entries)
        if num_new + num_revived > self.block_pool.num_free_blocks:
            return None
        # Hits first: one sitting in the free queue must be taken before a new block evicts it.
        self.block_pool.touch(b for entries in plan for b in entries if b is not None and b is not self._null)
        fresh = iter(self.block_pool.get_new_blocks(num_new))
        tables: list[list[Block]] = []
        filled: list[tuple[int, int, int]] = []
        for g, entries in enumerate(plan):
            table = []
            for i, block in enumerate(entries):
                if block is None:
                    block = next(fresh)
                    filled.append((g, i, block.block_id))
                table.append(block)
            tables.append(table)
        self._req_blocks[request.request_id] = tables
        return [[b.block_id for b in t] for t in tables], filled

    def cache_received(self, request: Request, num_tokens: int) -> None:
        """The KV of ``request``'s first ``num_tokens`` tokens has arrived in the blocks
        ``allocate_received`` gave it: make its full blocks findable."""
        tables = self._req_blocks.get(request.request_id)
        if tables and self.enable_prefix_caching:
            self._cache_full_blocks(request, tables, min(num_tokens // self.block_size, len(tables[0])))

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of ``request``'s first ``num_blocks`` full blocks (its prefix-cache
        identity, the same on every instance with this block size)."""
        self._update_block_hashes(request, num_blocks)
        return list(request.block_hashes[:num_blocks])

    def cache_computed_blocks(self, request: Request) -> None:
        """Make findable the full blocks whose every token ``request`` holds and has computed
        (a multi-step round computes several of its tokens after allocation, which caches only
        the blocks full by then)."""
        tables = self._req_blocks.get(request.request_id)
        if tables and self.enable_prefix_caching:
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, tables, min(num_full, len(tables[0])))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the tail blocks beyond the first ``num_tokens`` tokens (rejected
        speculative drafts' lookahead). Those blocks were never hashed: only tokens the
        request holds are, and drafts are not among them until accepted."""
        tables = self._req_blocks.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if not tables:
            return
        for blocks in tables:
            if len(blocks) <= keep:
                continue
            assert self._num_cached_blocks.get(request.request_id, 0) <= keep
            tail = blocks[keep:]
            del blocks[keep:]
            self.block_pool.free_blocks(b for b in reversed(tail) if b is not self._null)

    def free(self, request: Request) -> None:
        """Return every block of ``request`` at once; cached ones stay findable until evicted."""
        tables = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._req_nodes.pop(request.request_id, None)
        # Tail first, position by position across groups: a sequence's last blocks are the
        # least likely to be shared, evict them first.
        length = max((len(t) for t in tables), default=0)
        self.block_pool.free_blocks(t[i] for i in range(length - 1, -1, -1) for t in tables
                                    if i < len(t) and t[i] is not self._null)

    # ---- internals -----------------------------------------------------------------------

    def _first_needed_block(self, group: int, first_query: int) -> int:
        """The first block of ``group`` a query at ``first_query`` or later can see."""
        return first_visible_block(self.group_windows[group], self.block_size, first_query)

    def _releasable(self, blocks: list[Block], group: int, first_query: int) -> tuple[int, list[Block]]:
        """(n, the blocks among the first n entries of a sliding group's table not yet
        released): the entries no query from ``first_query`` on sees."""
        end = min(self._first_needed_block(group, first_query), len(blocks))
        if end == 0 or blocks[end - 1] is self._null:
            return end, []  # nothing new: entries before the last null one are null too
        return end, [b for b in blocks[:end] if b is not self._null]

    def _cache_full_blocks(self, request: Request, tables: list[list[Block]], num_full: int) -> None:
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        hashes = request.block_hashes[start:num_full]
        token_ids = [self._block_tokens(request, i) for i in range(start, num_full)]
        anchors: Sequence[Anchor]
        if self._prefix_index is None:
            full = tables[0]
            self.block_pool.cache_full_blocks(full[start:num_full], hashes, token_ids,
                                              parent=full[start - 1] if start > 0 else None)
            anchors = full[start:num_full]
        else:
            nodes = self._req_nodes.setdefault(request.request_id, [])
            assert len(nodes) == start, "a request's prefix nodes follow its cached blocks"
            parent = nodes[-1] if nodes else None
            for block_hash, tokens in zip(hashes, token_ids):
                parent = self._prefix_index.extend(block_hash, tokens, parent)
                nodes.append(parent)
            anchors = nodes[start:]
        for g in self._anchored_groups:
            self.block_pool.cache_full_blocks(tables[g][start:num_full], [_group_key(g, h) for h in hashes],
                                              token_ids, parent=None, anchors=anchors)
        self._num_cached_blocks[request.request_id] = num_full

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, self._block_tokens(request, i),
                                            self._prompt_tokens_in(request, i)))

    def _prompt_tokens_in(self, request: Request, index: int) -> Optional[int]:
        """How many prompt tokens full block ``index`` holds when its tokens' roles enter the
        hash (it holds generated ones and ``hash_prompt_boundary``), else None."""
        start = index * self.block_size
        if not self.hash_prompt_boundary or start + self.block_size <= request.num_prompt_tokens:
            return None
        return max(0, request.num_prompt_tokens - start)

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


def first_visible_block(window: Optional[int], block_size: int, query_position: int) -> int:
    """The first block a query at ``query_position`` (or later) sees in a group of ``window``
    (None: full attention, every block)."""
    if window is None:
        return 0
    return max(0, query_position - window + 1) // block_size


def _group_key(group: int, block_hash: BlockHash) -> BlockHash:
    """The index key of a group's block: the same token chain is a different block per group."""
    return block_hash + group.to_bytes(2, "little") if group else block_hash


def max_blocks_per_request(num_tokens: int, block_size: int, group_windows: Sequence[Optional[int]],
                           max_chunk: int) -> int:
    """Peak blocks, over all groups, of a request holding up to ``num_tokens`` tokens when one
    step computes at most ``max_chunk`` of them. A full group holds them all; a sliding group
    of window W holds, during a chunk of C tokens starting at p, the blocks of ``[p - W + 1,
    p + C)``: at most ``ceil((W - 1 + C) / block_size) + 1`` (the + 1: a range that does not
    start on a block boundary), ``ceil(W / block_size) + 1`` in steady decode."""
    full = -(-num_tokens // block_size)
    total = 0
    for window in group_windows:
        if window is None:
            total += full
        else:
            chunk = min(max_chunk, num_tokens)
            total += min(full, -(-(window - 1 + chunk) // block_size) + 1)
    return total
