"""Proof that a token prefix is cached when no KV table keeps the whole prefix. Torch-free.

A cached KV block is served only when its tokens and everything before them are the request's,
checked token for token and by identity; a hash only finds a candidate (``Block.holds``). A
full-attention group proves a prefix with its own blocks: each names the block before it (and
that block's generation), back to the first. A sliding-window group cannot: the blocks before
its window are given back and reused for other tokens. Beside a full group (Gemma 3) a sliding
block names the full group's block at its position. A model whose every layer slides (Mistral)
has no such group, so the prefix is kept apart from any KV:

A ``PrefixNode`` is one full block's token ids after its parent node: the nodes form a trie of
the prefixes that cached blocks hold. A node never changes and is never reused for other
tokens (so it needs no generation). Each cached block of such a model names the node of its own
position as its anchor, the way a Gemma sliding block names the full group's block, and keeps
it, and through it the whole prefix, alive; a running request keeps its nodes too.
``PrefixIndex`` finds a node by the block's chained hash, weakly: a node that no block and no
request holds any more leaves the index by itself.

A lookup walks the request's full blocks from the first: node i is verified when the node
indexed under hash i has block i's tokens and *is* verified node i - 1's child. A colliding
hash finds a node whose tokens or parent differ, and the walk stops there: a hash never stands
in for a prefix. Then a sliding block at position i is served when it holds block i's tokens
and names verified node i (kv_manager.py), exactly as against a full group's block. Cost: one
node (a tuple of the block's token ids and a reference) per full block of the chains that
cached blocks or running requests hold.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

from kvserve.block_pool import BlockHash


@dataclass(eq=False)
class PrefixNode:
    token_ids: tuple[int, ...]
    parent: Optional["PrefixNode"]
    # A block cached against an anchor records the anchor's generation (a full group's block is
    # handed out again with another); a node is never reused, so it has one.
    generation: ClassVar[int] = 0


class PrefixIndex:
    """The live prefix nodes by the chained hash of their block."""

    def __init__(self) -> None:
        self._nodes: weakref.WeakValueDictionary[BlockHash, PrefixNode] = weakref.WeakValueDictionary()

    def __len__(self) -> int:
        return len(self._nodes)

    def find(self, block_hash: BlockHash, token_ids: tuple[int, ...],
             parent: Optional[PrefixNode]) -> Optional[PrefixNode]:
        """The indexed node of ``token_ids`` after ``parent`` (a verified node; None for the
        first block), or None."""
        node = self._nodes.get(block_hash)
        if node is None or node.parent is not parent or node.token_ids != token_ids:
            return None
        return node

    def extend(self, block_hash: BlockHash, token_ids: tuple[int, ...],
               parent: Optional[PrefixNode]) -> PrefixNode:
        """The node of ``token_ids`` after ``parent``: the indexed one, else a new one, indexed
        unless another live node holds the hash (a collision: the newcomer stays unfindable,
        as a block pool's duplicate does)."""
        node = self.find(block_hash, token_ids, parent)
        if node is None:
            node = PrefixNode(token_ids, parent)
            self._nodes.setdefault(block_hash, node)
        return node

    def verified_prefix(self, block_hashes: Sequence[BlockHash],
                        block_tokens: Callable[[int], tuple[int, ...]]) -> list[PrefixNode]:
        """The nodes of the longest indexed prefix of a sequence whose full block i has hash
        ``block_hashes[i]`` and tokens ``block_tokens(i)``, each verified against its tokens
        and its parent."""
        chain: list[PrefixNode] = []
        parent = None
        for i, block_hash in enumerate(block_hashes):
            node = self.find(block_hash, block_tokens(i), parent)
            if node is None:
                break
            chain.append(node)
            parent = node
        return chain
