"""KVCacheManager: prefix sharing, hit accounting, collision safety, all-or-nothing allocation."""
import pytest

from kvserve import kv_manager as kv_manager_module
from kvserve.kv_manager import KVCacheManager
from kvserve.request import Request, SamplingParams

BS = 4


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def _admit(kv, request):
    """What the scheduler does for a waiting request: lookup, then allocate the rest; returns
    group 0's table (the only one here)."""
    hit_ids, num_hit = kv.get_computed_blocks(request)
    tables = kv.allocate_slots(request, request.num_tokens - num_hit, hit_ids, num_hit)
    if tables is not None:
        request.num_computed_tokens = num_hit
    return (tables[0] if tables is not None else None), num_hit


def _ref_counts(kv):
    return [b.ref_cnt for b in kv.block_pool.blocks]


def test_eight_requests_share_a_three_block_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 112))  # 3 full blocks
    requests = [_req(f"r{i}", prefix + [i, i, i]) for i in range(8)]  # 15 tokens: 4 blocks each

    ids0, hit0 = _admit(kv, requests[0])
    assert hit0 == 0 and len(ids0) == 4
    tables = [ids0]
    for r in requests[1:]:
        ids, hit = _admit(kv, r)
        assert hit == 12
        assert ids[:3] == ids0[:3] and ids[3] not in ids0
        tables.append(ids)

    shared = ids0[:3]
    assert all(kv.block_pool.blocks[b].ref_cnt == 8 for b in shared)
    assert len({t[3] for t in tables}) == 8
    assert kv.num_used_blocks == 3 + 8
    assert kv.num_free_blocks == 16 - 11
    assert kv.usage == pytest.approx(11 / 16)
    assert kv.prefix_cache_queries == 8 * 15
    assert kv.prefix_cache_hits == 7 * 12
    assert kv.get_block_ids("r3") == tables[3]

    for r in requests:
        kv.free(r)
    assert kv.num_used_blocks == 0 and all(c == 0 for c in _ref_counts(kv))
    # The prefix outlives its requests: a newcomer still finds it.
    _, hit = _admit(kv, _req("late", prefix + [7]))
    assert hit == 12


def test_last_prompt_token_is_always_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(12))  # exactly 3 full blocks
    _admit(kv, _req("a", prompt))
    # Whole prompt cached: back off one block so the last token is computed.
    assert kv.get_computed_blocks(_req("b", prompt))[1] == 8
    assert kv.get_computed_blocks(_req("c", prompt + [99]))[1] == 12
    assert kv.get_computed_blocks(_req("d", prompt[:4]))[1] == 0
    assert kv.get_computed_blocks(_req("e", prompt[:5]))[1] == 4


def test_hash_collision_never_serves_foreign_tokens(monkeypatch):
    monkeypatch.setattr(kv_manager_module, "hash_block_tokens", lambda parent, tokens, *roles: b"collide")
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    _admit(kv, _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    ids, hit = _admit(kv, _req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]))
    assert hit == 0
    # Same tokens still hit through the colliding hash: verification passes.
    assert kv.get_computed_blocks(_req("c", [1, 2, 3, 4, 0]))[1] == 4


def test_hash_that_ignores_the_parent_cannot_splice_prefixes(monkeypatch):
    # A hash of the block's own tokens only: [R, S] collides with [P, Q, S] at S.
    monkeypatch.setattr(kv_manager_module, "hash_block_tokens", lambda parent, tokens, *roles: repr(tokens).encode())
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    P, Q, R, S = [1] * 4, [2] * 4, [3] * 4, [4] * 4
    _admit(kv, _req("a", P + Q + S + [0]))
    _admit(kv, _req("d", R + S + [0]))  # its S block is a duplicate hash: stays unindexed
    # R hits d's block, S's index entry is a's block (which follows Q, not R): must miss.
    assert kv.get_computed_blocks(_req("b", R + S + [5]))[1] == 4
    assert kv.get_computed_blocks(_req("e", P + Q + S + [5]))[1] == 12


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = _req("a", range(9))  # 3 blocks, 2 of them full and cached
    _admit(kv, a)
    kv.free(a)
    c = _req("c", [50] * 8)
    assert _admit(kv, c)[1] == 0  # takes the 2 never-cached blocks from the head
    assert kv.num_free_blocks == 2

    b = _req("b", list(range(8)) + [70] * 5)  # hits a's 2 free cached blocks, needs 2 more
    before = (_ref_counts(kv), kv.num_free_blocks, kv.block_pool.num_cached_blocks)
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # Reviving the 2 hit blocks uses up the free budget: no room for 2 new blocks.
    assert kv.allocate_slots(b, 5, hit_ids, num_hit) is None
    assert (_ref_counts(kv), kv.num_free_blocks, kv.block_pool.num_cached_blocks) == before
    assert kv.get_block_ids("b") == [] and b.num_computed_tokens == 0
    c.num_computed_tokens = 8
    assert kv.allocate_slots(c, 9) is None  # growth of a running request: 3 new blocks, 2 free
    assert kv.get_block_ids("c") == [3, 2]  # the never-used block, then a's uncached tail block
    assert (_ref_counts(kv), kv.num_free_blocks) == before[:2]

    kv.free(c)
    ids, num_hit = _admit(kv, b)
    assert num_hit == 8 and ids[:2] == hit_ids[0] and len(ids) == 4


def test_decode_growth_caches_output_blocks_and_lookahead():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", [1, 2, 3])
    ids, _ = _admit(kv, a)
    assert len(ids) == 1 and a.block_hashes == []
    a.num_computed_tokens = 3
    for tok in [4, 5, 6]:  # decode: the sampled token is fed back one step later
        a.output_token_ids.append(tok)
        ids = kv.allocate_slots(a, 1)[0]
        a.num_computed_tokens += 1
    assert len(ids) == 2 and len(a.block_hashes) == 1  # 6 tokens: one full block so far
    assert kv.get_computed_blocks(_req("x", [1, 2, 3, 4, 9]))[1] == 4

    assert len(kv.allocate_slots(a, 1, lookahead=5)[0]) == 3  # 7 + 5 tokens need 3 blocks
    assert len(a.block_hashes) == 1  # lookahead slots hold no known tokens yet


def test_free_returns_everything_and_is_idempotent():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = _req("a", range(10))
    _admit(kv, a)
    assert kv.num_used_blocks == 3
    kv.free(a)
    kv.free(a)
    kv.free(_req("never", [1]))
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 6
    assert kv.get_block_ids("a") == []


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    _admit(kv, _req("a", prompt))
    assert kv.get_computed_blocks(_req("b", prompt)) == ([[]], 0)
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0
    assert kv.block_pool.num_cached_blocks == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = _req("a", range(9))
    _admit(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_req("b", range(9)))[1] == 0


def _generate(kv, request, tokens):
    """Decode ``tokens`` one by one after the prompt (each fed back one step later)."""
    request.num_computed_tokens = request.num_tokens
    for tok in tokens:
        request.output_token_ids.append(tok)
        kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1


@pytest.mark.parametrize("boundary", [False, True])
def test_prompt_boundary_in_the_hash_of_blocks_with_generated_tokens(boundary):
    """Multi-turn: B's prompt is A's prompt and output. Where the KV depends on a token's role
    (int4's bf16 prefill weights), B may reuse A's prompt-only blocks but not those holding
    A's generated tokens: B computes those tokens as prompt tokens."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, hash_prompt_boundary=boundary)
    prompt = list(range(100, 110))  # 2 full blocks, then 2 prompt tokens in the third
    a = _req("a", prompt)
    _admit(kv, a)
    _generate(kv, a, [7, 8, 9, 10, 11, 12, 13])  # 17 tokens: blocks 2 (mixed) and 3 (generated) full
    assert len(a.block_hashes) == 4
    b = _req("b", a.all_token_ids + [5])
    _, hit = _admit(kv, b)
    assert hit == (8 if boundary else 16)
    # Prompt-only blocks hash as without the flag: the same for every request.
    plain = KVCacheManager(num_blocks=16, block_size=BS)
    c = _req("c", prompt + [1])
    plain.get_computed_blocks(c)
    assert a.block_hashes[:2] == c.block_hashes[:2] == b.block_hashes[:2]
    assert (a.block_hashes[2] != b.block_hashes[2]) == boundary
    # A request repeating A's whole history as its own history (A itself, recomputed after
    # preemption) finds every block A cached.
    again = _req("again", prompt)
    again.output_token_ids = list(a.output_token_ids)
    assert kv.get_computed_blocks(again)[1] == 16
