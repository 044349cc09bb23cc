"""KV cache groups in the torch-free bookkeeping: sliding-window groups give blocks back as
decoding proceeds, prefix hits need each group's last window, every group's blocks come back;
with a full group beside them (Gemma 3) or without one (Mistral: every group sliding).

The fake model reads its input out of a simulated paged store per group, through each group's
block table: the full group sees the whole sequence, a sliding group only the last W tokens.
A block released too early, shared wrongly or read through the null block changes the tokens.
"""
import math
import random

import pytest

from kvserve import kv_manager as kv_manager_module
from kvserve.kv_manager import KVCacheManager, first_visible_block, max_blocks_per_request
from kvserve.prefix_index import PrefixIndex
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.scheduler import Scheduler

VOCAB = 32


def _mix(pairs):
    acc = 0
    for pos, tok in pairs:
        acc = (acc * 31 + (pos + 1) * (tok + 7)) % 1_000_003
    return acc


def next_token(tokens, windows):
    """Full groups read every token, a sliding group of window W the last W (with positions)."""
    n = len(tokens)
    acc = 0
    for w in windows:
        first = 0 if w is None else max(0, n - w)
        acc = (acc * 17 + _mix((p, tokens[p]) for p in range(first, n))) % 1_000_003
    return acc % VOCAB


def reference(prompt, max_tokens, windows):
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        tok = next_token(seq, windows)
        out.append(tok)
        seq.append(tok)
    return out


class GroupedFakeRunner:
    def __init__(self, kv, read_tables_only=False):
        self.kv = kv
        # Long runs: check what a query would read is on real blocks, sample a constant.
        self.read_tables_only = read_tables_only
        self.bs = kv.block_size
        self.null = kv.block_pool.null_block.block_id if kv.block_pool.null_block else None
        self.stores = [{} for _ in kv.group_windows]

    def _slot(self, table, pos):
        return table[pos // self.bs] * self.bs + pos % self.bs

    def run(self, out):
        for c in out.chunks:  # every group's K/V of the whole batch first, as attention does
            tokens = c.request.all_token_ids
            for g, table in enumerate(c.block_tables):
                for pos in range(c.start_position, c.start_position + c.num_new_tokens):
                    assert table[pos // self.bs] != self.null, "a new token written to the null block"
                    self.stores[g][self._slot(table, pos)] = tokens[pos]
        sampled = {}
        for c in out.chunks:
            if not c.needs_sample:
                continue
            n = c.start_position + c.num_new_tokens
            if self.read_tables_only:
                for w, table in zip(self.kv.group_windows, c.block_tables):
                    first = 0 if w is None else max(0, n - w)
                    assert self.null not in table[first // self.bs:(n - 1) // self.bs + 1]
                sampled[c.request.request_id] = 5
                continue
            acc = 0
            for g, (w, table) in enumerate(zip(self.kv.group_windows, c.block_tables)):
                first = 0 if w is None else max(0, n - w)
                seen = []
                for p in range(first, n):
                    assert table[p // self.bs] != self.null, f"visible position {p} on the null block"
                    seen.append((p, self.stores[g].get(self._slot(table, p))))
                acc = (acc * 17 + _mix(seen)) % 1_000_003
            sampled[c.request.request_id] = acc % VOCAB
        return sampled


def make(windows, num_blocks=64, block_size=4, budget=16, max_num_seqs=8, max_model_len=256, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching, group_windows=windows)
    return Scheduler(kv, budget, max_num_seqs, max_model_len), GroupedFakeRunner(kv)


def req(rid, prompt, max_tokens=4):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=[0])


def step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner.run(out))
    return out


def _check_refs(sched):
    kv = sched.kv_manager
    holders = {}
    for r in sched.running:
        for g in range(kv.num_groups):
            for b in kv.get_block_ids(r.request_id, g):
                if b != 0:
                    holders[b] = holders.get(b, 0) + 1
    refs = [b.ref_cnt for b in kv.block_pool.blocks]
    assert refs[0] == 1  # the null block, held forever
    assert refs[1:] == [holders.get(i, 0) for i in range(1, kv.num_blocks)]


def test_decode_holds_a_window_and_frees_every_block():
    W, BS = 10, 4
    windows = [None, W, W]
    sched, runner = make(windows, num_blocks=400, block_size=BS, budget=8, max_model_len=1200)
    r = req("a", range(1, 30), max_tokens=1000)
    sched.add_request(r)
    kv = sched.kv_manager
    peak_prefill = 0
    while sched.has_unfinished_requests():
        out = step(sched, runner)
        if not r.is_finished:
            held = [kv.num_held_blocks("a", g) for g in (1, 2)]
            if out.chunks[0].num_new_tokens == 1:
                assert max(held) <= math.ceil(W / BS) + 1
            peak_prefill = max(peak_prefill, *held)
            assert kv.num_held_blocks("a", 0) == kv.num_blocks_for(r.num_computed_tokens)
    assert peak_prefill <= math.ceil((W - 1 + 8) / BS) + 1
    assert r.output_token_ids == reference(range(1, 30), 1000, windows)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks == 399


def test_4000_decode_steps_of_a_gemma_shaped_model():
    """Gemma 3's shape (one full group, five sliding groups of window 512, 16-token blocks):
    4,000 decode steps hold at most ceil(W / block) + 1 blocks per sliding group, every key a
    query sees is on a real block, and every block comes back at the end."""
    W, BS = 512, 16
    windows = [None] + [W] * 5
    sched, _ = make(windows, num_blocks=1200, block_size=BS, budget=2048, max_model_len=8192)
    kv = sched.kv_manager
    runner = GroupedFakeRunner(kv, read_tables_only=True)
    prompt = [(3 * i) % VOCAB for i in range(600)]
    r = req("a", prompt, max_tokens=4001)
    sched.add_request(r)
    decode_steps = 0
    while sched.has_unfinished_requests():
        out = step(sched, runner)
        if out.chunks[0].num_new_tokens == 1:
            decode_steps += 1
            if not r.is_finished:
                assert max(kv.num_held_blocks("a", g) for g in range(1, 6)) <= math.ceil(W / BS) + 1
    assert decode_steps == 4000 and len(r.output_token_ids) == 4001
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks == 1199


def test_chunk_longer_than_the_window():
    W, BS, C = 6, 4, 20
    windows = [None, W]
    sched, runner = make(windows, block_size=BS, budget=C)
    prompt = [(7 * i) % VOCAB for i in range(70)]
    sched.add_request(req("a", prompt, max_tokens=5))
    kv = sched.kv_manager
    while sched.has_unfinished_requests():
        step(sched, runner)
        if sched.running:
            assert kv.num_held_blocks("a", 1) <= math.ceil((W - 1 + C) / BS) + 1
    assert sched.get_request("a") is None and kv.num_used_blocks == 0


def test_prefix_hit_needs_the_last_window_of_each_group():
    W, BS = 8, 4
    windows = [None, W]
    sched, runner = make(windows, block_size=BS, budget=64)
    kv = sched.kv_manager
    prompt = list(range(1, 41))  # 10 blocks
    a = req("a", prompt, max_tokens=1)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        step(sched, runner)
    # a is done: its sliding blocks were released as it went, all stay findable while free.
    b = req("b", prompt + [5, 6, 7])
    ids, hit = kv.get_computed_blocks(b)
    assert hit == 40
    # A query at 40 sees keys 33..39: blocks 8 and 9; blocks 0..7 of the sliding table are null.
    assert ids[1][:8] == [0] * 8 and 0 not in ids[1][8:] and len(ids[1]) == 10
    assert len(ids[0]) == 10 and 0 not in ids[0]

    # Evict the sliding group's block 9 (positions 36..39): the hit falls back to h = 36,
    # whose window (29..35) is still cached.
    victim = kv.block_pool.blocks[ids[1][9]]
    kv.block_pool._evict(victim)
    ids, hit = kv.get_computed_blocks(b)
    assert hit == 36 and len(ids[0]) == 9 and ids[1][:7] == [0] * 7

    sched.add_request(b)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert b.num_cached_tokens == 36
    assert b.output_token_ids == reference(prompt + [5, 6, 7], 4, windows)


def test_capacity_counts_the_groups():
    # An 8,192-token request of Gemma 3's shape in blocks of 3 layers: 3 full layers keep every
    # block, 5 sliding groups of 3 layers keep ~528 tokens each (one chunk more while prefilling).
    bs, n = 16, 8192
    full = max_blocks_per_request(n, bs, [None], 1)
    assert full == 512
    grouped_decode = max_blocks_per_request(n, bs, [None] + [512] * 5, 1)
    assert grouped_decode == 512 + 5 * 33
    grouped_prefill = max_blocks_per_request(n, bs, [None] + [512] * 5, 2048)
    assert grouped_prefill == 512 + 5 * (math.ceil((511 + 2048) / 16) + 1)
    # Bytes: today a block holds 18 layers, now 3: the same memory holds 6x the block ids.
    assert 6 * full / grouped_decode >= 4


def _simulate(seed, with_full_group=True):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    W = rng.randint(2, 12)
    windows = [None] + [W] * rng.randint(1, 3)
    if not with_full_group:
        windows = windows[1:]
    budget = rng.randint(3, 24)
    num_blocks = rng.randint(12, 40)
    sched, runner = make(windows, num_blocks, bs, budget, rng.randint(1, 6), max_model_len=64,
                         caching=rng.random() < 0.85)
    kv = sched.kv_manager
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    arrivals = []
    for i in range(rng.randint(6, 14)):
        prompt = rng.choice(prefixes)[: rng.randint(1, 30)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))]
        max_tokens = rng.randint(1, 30)
        r = req(f"r{i}", prompt, max_tokens)
        try:
            sched.check_fits(r)
        except Exception:
            continue
        arrivals.append((rng.randint(0, 25), r))
    everyone, aborted = [], set()
    for t in range(5000):
        for when, r in arrivals:
            if when == t:
                sched.add_request(r)
                everyone.append(r)
        if t > 25 and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for r in sched.waiting:
            assert all(kv.get_block_ids(r.request_id, g) == [] for g in range(kv.num_groups))
        sched.update_from_output(out, runner.run(out))
        _check_refs(sched)
        if everyone and rng.random() < 0.03:
            victim = rng.choice(everyone)
            if not victim.is_finished:
                aborted.add(victim.request_id)
            sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
    else:
        raise AssertionError(f"seed {seed}: requests did not finish")
    for r in everyone:
        if r.request_id not in aborted:
            assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens, windows), seed
    assert kv.num_used_blocks == 0
    return sched


@pytest.mark.parametrize("with_full_group", [True, False], ids=["gemma-like", "all-sliding"])
def test_simulation_matches_running_alone(with_full_group):
    preemptions = hits = 0
    for seed in range(40):
        sched = _simulate(seed, with_full_group)
        preemptions += sched.num_preemptions
        hits += sched.kv_manager.prefix_cache_hits
        # Nothing runs: the prefix nodes left are those of cached blocks, gone with them.
        sched.kv_manager.reset_prefix_cache()
        assert sched.kv_manager.num_prefix_nodes == 0
    assert preemptions > 10 and hits > 100


def test_one_full_group_is_unchanged():
    kv = KVCacheManager(8, 4)
    assert kv.block_pool.null_block is None and kv.num_usable_blocks == 8
    with pytest.raises(ValueError, match="group 0"):
        KVCacheManager(8, 4, group_windows=[8, None])


# ---- every group sliding (Mistral): no full group to anchor prefix hits on


@pytest.mark.parametrize("windows", [[10], [10, 6]])
def test_all_sliding_decode_holds_a_window_and_frees_every_block(windows):
    """A 1,029-token request in a pool of 199 blocks of 4 tokens (796 tokens): each group
    holds its window (plus a chunk while prefilling), entries before it point at the null
    block, and every block comes back."""
    BS, C = 4, 8
    sched, runner = make(windows, num_blocks=200, block_size=BS, budget=C, max_model_len=1200)
    kv = sched.kv_manager
    assert kv.block_pool.null_block is not None
    r = req("a", range(1, 30), max_tokens=1000)
    sched.add_request(r)
    while sched.has_unfinished_requests():
        out = step(sched, runner)
        if r.is_finished:
            continue
        start = out.chunks[0].start_position
        decoding = out.chunks[0].num_new_tokens == 1
        for g, w in enumerate(windows):
            table = kv.get_block_ids("a", g)
            first = first_visible_block(w, BS, start)
            assert set(table[:first]) <= {0} and 0 not in table[first:]
            bound = math.ceil(w / BS) + 1 if decoding else math.ceil((w - 1 + C) / BS) + 1
            assert kv.num_held_blocks("a", g) <= bound
    assert len(r.output_token_ids) == 1000 and r.num_tokens > kv.num_usable_blocks * BS
    assert r.output_token_ids == reference(range(1, 30), 1000, windows)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks == 199
    kv.reset_prefix_cache()
    assert kv.num_prefix_nodes == 0


def test_all_sliding_prefix_hit_is_searched_from_the_right():
    W, BS = 8, 4
    sched, runner = make([W], block_size=BS, budget=64)
    kv = sched.kv_manager
    prompt = list(range(1, 41))  # 10 blocks
    sched.add_request(req("a", prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched, runner)
    b = req("b", prompt + [5, 6, 7])
    ids, hit = kv.get_computed_blocks(b)
    # A query at 40 sees keys 33..39: blocks 8 and 9; the entries before are the null block.
    assert hit == 40 and len(ids) == 1
    assert ids[0][:8] == [0] * 8 and 0 not in ids[0][8:] and len(ids[0]) == 10

    # Without block 9 a hit of 36 needs blocks 7 and 8; without block 7 too, the search goes
    # on from block 7 down: 28 needs blocks 5 and 6, cached.
    kv.block_pool._evict(kv.block_pool.blocks[ids[0][9]])
    ids, hit = kv.get_computed_blocks(b)
    assert hit == 36 and ids[0][:7] == [0] * 7 and len(ids[0]) == 9
    kv.block_pool._evict(kv.block_pool.blocks[ids[0][7]])
    ids, hit = kv.get_computed_blocks(b)
    assert hit == 28 and ids[0][:5] == [0] * 5 and len(ids[0]) == 7

    sched.add_request(b)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert b.num_cached_tokens == 28
    assert b.output_token_ids == reference(prompt + [5, 6, 7], 4, [W])
    assert kv.num_used_blocks == 0


def _admit(kv, request):
    hit_ids, num_hit = kv.get_computed_blocks(request)
    tables = kv.allocate_slots(request, request.num_tokens - num_hit, hit_ids, num_hit)
    assert tables is not None
    request.num_computed_tokens = num_hit
    return tables, num_hit


def test_all_sliding_hash_collision_never_serves_foreign_tokens(monkeypatch):
    monkeypatch.setattr(kv_manager_module, "hash_block_tokens", lambda parent, tokens, *roles: b"collide")
    kv = KVCacheManager(16, 4, group_windows=[8])
    _admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert kv.get_computed_blocks(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]))[1] == 0
    # a's second block follows another node under the same hash: never findable.
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]))[1] == 4
    assert kv.get_computed_blocks(req("d", [1, 2, 3, 4, 0]))[1] == 4


def test_all_sliding_hash_that_ignores_the_parent_cannot_splice_prefixes(monkeypatch):
    # A hash of the block's own tokens only: [R, S] collides with [P, Q, S] at S. Window 8:
    # a hit of 12 needs the blocks of keys 5..11, the ones holding Q and S.
    monkeypatch.setattr(kv_manager_module, "hash_block_tokens", lambda parent, tokens, *roles: repr(tokens).encode())
    kv = KVCacheManager(32, 4, group_windows=[8])
    P, Q, R, S = [1] * 4, [2] * 4, [3] * 4, [4] * 4
    _admit(kv, req("a", P + Q + S + [0]))
    _admit(kv, req("d", R + S + [0]))  # its S node follows R: the index keeps a's, after Q
    assert kv.get_computed_blocks(req("b", R + S + [5]))[1] == 4
    assert kv.get_computed_blocks(req("e", P + Q + S + [5]))[1] == 12


def test_all_sliding_allocation_is_all_or_nothing_and_free_returns_everything():
    W, BS = 8, 4
    kv = KVCacheManager(8, BS, group_windows=[W])  # 7 usable blocks
    a = req("a", range(1, 21))  # 5 blocks at once while its prompt is one chunk
    tables, _ = _admit(kv, a)
    assert kv.num_used_blocks == 5 and 0 not in tables[0]
    b = req("b", range(50, 63))  # 4 blocks: no room
    before = ([blk.ref_cnt for blk in kv.block_pool.blocks], kv.num_free_blocks)
    assert kv.allocate_slots(b, 13) is None
    assert ([blk.ref_cnt for blk in kv.block_pool.blocks], kv.num_free_blocks) == before
    assert kv.get_block_ids("b") == []
    # a decodes: its next query at 20 sees keys 13..19, so blocks 0..2 go back, and b fits.
    a.num_computed_tokens = 20
    a.output_token_ids.append(7)
    assert kv.allocate_slots(a, 1)[0][:3] == [0, 0, 0] and kv.num_held_blocks("a", 0) == 3
    assert kv.allocate_slots(b, 13) is not None and kv.num_used_blocks == 7
    kv.free(a)
    kv.free(b)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks == 7
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [1] + [0] * 7
    # Cached blocks hold their prefix nodes, and a node its parents: a's 5 (its blocks 3 and 4
    # are still cached) and b's 3 full blocks. Blocks taken for other tokens let them go.
    assert kv.num_prefix_nodes == 5 + 3
    c = req("c", range(100, 128))
    kv.allocate_slots(c, 28)
    assert kv.num_prefix_nodes == 7  # c's own, none of a's or b's
    kv.free(c)
    kv.reset_prefix_cache()
    assert kv.num_prefix_nodes == 0


def test_full_groups_come_first():
    with pytest.raises(ValueError, match="group 0"):
        KVCacheManager(8, 4, group_windows=[8, None])
    assert KVCacheManager(8, 4, group_windows=[8, 4]).num_usable_blocks == 7
    # Mistral-7B's shape: one group of window 4,096; a 32k-token request holds 257 blocks of
    # 16 in steady decode, 385 while a chunk of 2,048 is prefilled, instead of 2,048.
    assert max_blocks_per_request(32768, 16, [4096], 1) == 257
    assert max_blocks_per_request(32768, 16, [4096], 2048) == 385
    assert max_blocks_per_request(32768, 16, [None], 2048) == 2048


def test_prefix_index_verifies_tokens_and_parents_and_forgets_unheld_nodes():
    index = PrefixIndex()
    a0 = index.extend(b"h0", (1, 2), None)
    a1 = index.extend(b"h1", (3, 4), a0)
    assert index.extend(b"h0", (1, 2), None) is a0  # the same prefix: the same node
    tokens = {0: (1, 2), 1: (3, 4)}
    assert index.verified_prefix([b"h0", b"h1"], tokens.get) == [a0, a1]
    # A colliding hash (other tokens, or the same tokens after another parent) is no proof.
    other = index.extend(b"h1", (3, 4), index.extend(b"g0", (9, 9), None))
    assert other is not a1 and index.find(b"h1", (3, 4), other.parent) is None
    assert index.verified_prefix([b"h0", b"h1"], {0: (1, 2), 1: (5, 6)}.get) == [a0]
    assert len(index) == 3
    # Nothing holds a node but the index: it goes; a child keeps its parents.
    del a0, other
    assert len(index) == 2 and index.find(b"h0", (1, 2), None) is a1.parent
    del a1
    assert len(index) == 0
