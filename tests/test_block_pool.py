"""BlockPool: ref counts, LRU free queue, the hash index and eviction. Torch-free."""
import subprocess
import sys

import pytest

from kvserve.block_pool import BlockPool


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_bookkeeping_modules_do_not_import_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvserve.block_pool, kvserve.kv_manager, kvserve.scheduler\n"
        "assert sys.modules['torch'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocation_takes_from_head_and_counts_refs():
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert _ids(a) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)

    pool.touch(a[:1])
    assert a[0].ref_cnt == 2
    pool.free_blocks(a[:1])
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 1  # still held once
    pool.free_blocks(a)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(ValueError):
        pool.free_blocks(a[:1])


def test_lru_order_freed_blocks_go_to_tail():
    pool = BlockPool(5, enable_caching=True)
    seq = pool.get_new_blocks(3)  # 0, 1, 2; 3 and 4 remain free
    pool.free_blocks(reversed(seq))  # tail block of the sequence first
    # Never-used blocks first, then the freed ones in the order they were freed.
    assert _ids(pool.get_new_blocks(5)) == [3, 4, 2, 1, 0]


def _cache(pool, blocks, tag):
    hashes = [f"{tag}{i}".encode() for i in range(len(blocks))]
    tokens = [(ord(tag[0]), i) for i in range(len(blocks))]
    pool.cache_full_blocks(blocks, hashes, tokens, parent=None)
    return hashes, tokens


def test_cached_block_revived_from_free_queue():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes, tokens = _cache(pool, blocks, "a")
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2

    hit = pool.get_cached_block(hashes[0])
    assert hit is blocks[0] and hit.holds(tokens[0], None)
    assert blocks[1].holds(tokens[1], blocks[0])
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3
    # The revived block is out of the free queue: allocation never hands it out.
    rest = pool.get_new_blocks(3)
    assert hit not in rest
    assert pool.get_cached_block(hashes[0]) is hit


def test_eviction_drops_hash_and_invalidates_children():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes, tokens = _cache(pool, blocks, "a")
    pool.free_blocks(blocks)  # head of the free queue: blocks[0]
    parent_generation = blocks[0].generation

    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[0]
    assert pool.get_cached_block(hashes[0]) is None
    assert reused.block_hash is None and reused.token_ids is None
    assert reused.generation == parent_generation + 1
    # The child is still indexed, but its parent's content is gone: it no longer verifies.
    child = pool.get_cached_block(hashes[1])
    assert child is blocks[1]
    assert not child.holds(tokens[1], reused)


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [b"h"], [(1, 2)], parent=None)
    pool.cache_full_blocks([second], [b"h"], [(1, 2)], parent=None)
    assert pool.get_cached_block(b"h") is first
    assert not second.is_cached
    # Evicting the uncached duplicate must not drop the first block's entry.
    pool.free_blocks([second])
    pool.get_new_blocks(3)
    assert pool.get_cached_block(b"h") is first


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], [(1,)], parent=None)
    assert pool.get_cached_block(b"h") is None and not blocks[0].is_cached


def test_reset_prefix_cache():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes, _ = _cache(pool, blocks, "a")
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert all(pool.get_cached_block(h) is None for h in hashes)
    assert pool.num_free_blocks == 3


def test_null_block_is_never_handed_out_or_cached():
    pool = BlockPool(4, enable_caching=True, reserve_null_block=True)
    assert pool.null_block is pool.blocks[0] and pool.num_usable_blocks == 3
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 0 and pool.usage == 0
    blocks = pool.get_new_blocks(3)
    assert pool.null_block not in blocks and pool.usage == 1
    pool.cache_full_blocks([pool.null_block], [b"n"], [(1,)], parent=None)
    assert pool.get_cached_block(b"n") is None
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_anchored_blocks_are_verified_against_their_anchor():
    # A sliding-window group's block names the full group's block at its position: it stays a
    # hit while that anchor is unchanged, whatever happened to the blocks before it.
    pool = BlockPool(4, enable_caching=True)
    anchor, sliding = pool.get_new_blocks(2)
    pool.cache_full_blocks([sliding], [b"s"], [(1, 2)], parent=None, anchors=[anchor])
    assert pool.get_cached_block(b"s").holds((1, 2), anchor)
    pool.free_blocks([anchor])
    pool.get_new_blocks(3)  # evicts and hands out the anchor again: a new generation
    assert not sliding.holds((1, 2), anchor)
