"""Scheduler: token budget, chunked prefill, preemption, admission, stop rules; a simulation.

The fake "model" here reads its input back out of a simulated paged KV store through the
block tables the scheduler hands out, so a block shared, reused or evicted wrongly changes
the generated tokens.
"""
import random
from collections import deque

import pytest

from kvserve.kv_manager import KVCacheManager
from kvserve.request import Request, RequestRejected, RequestStatus, SamplingParams
from kvserve.scheduler import Scheduler

from fake_model import EOS, VOCAB, next_token, paged_slot, reference  # noqa: F401 (VOCAB: other tests)

class FakeRunner:
    """Writes each scheduled token into its paged slot, then samples from what it reads back.

    It also checks that no slot is written twice while its block keeps one owner history
    (generation): a cached block must be reused, never recomputed in place.
    """

    def __init__(self, kv):
        self.kv = kv
        self.block_size = kv.block_size
        self.store = {}
        self.written_in_generation = {}

    def _slot(self, block_ids, pos):
        return paged_slot(block_ids, self.block_size, pos)

    def run(self, out):
        # Like an attention layer: the whole batch's K/V is written before any of it is read.
        for c in out.chunks:
            # Aborted while its step was in flight (pipelining): it still runs, and a later step
            # may share its blocks through the prefix cache (they hold the right KV once this
            # step has run) or own them afresh (and write them again, after this step).
            aborted = c.request.is_finished
            tokens = c.request.all_token_ids
            assert c.start_position + c.num_new_tokens <= len(tokens)
            assert len(c.block_ids) * self.block_size >= c.start_position + c.num_new_tokens
            for pos in range(c.start_position, c.start_position + c.num_new_tokens):
                slot = self._slot(c.block_ids, pos)
                generation = self.kv.block_pool.blocks[slot // self.block_size].generation
                if not aborted:
                    assert self.written_in_generation.get(slot) != generation, f"slot {slot} rewritten"
                    self.written_in_generation[slot] = generation
                self.store[slot] = tokens[pos]
        sampled = {}
        for c in out.chunks:
            if c.needs_sample:
                n = c.start_position + c.num_new_tokens
                seen = [self.store.get(self._slot(c.block_ids, p)) for p in range(n)]
                sampled[c.request.request_id] = next_token(seen)
        if out.num_steps > 1:  # a multi-step round: each later step decodes the token before
            sampled = {rid: [tok] for rid, tok in sampled.items()}
            for _ in range(out.num_steps - 1):
                for c in out.chunks:
                    tokens = sampled[c.request.request_id]
                    pos = c.start_position + len(tokens)  # the lookahead slot of this step's input
                    assert len(c.block_ids) * self.block_size > pos, "no lookahead slot"
                    slot = self._slot(c.block_ids, pos)
                    generation = self.kv.block_pool.blocks[slot // self.block_size].generation
                    assert self.written_in_generation.get(slot) != generation, f"slot {slot} rewritten"
                    self.written_in_generation[slot] = generation
                    self.store[slot] = tokens[-1]
                    tokens.append(next_token([self.store.get(self._slot(c.block_ids, p)) for p in range(pos + 1)]))
        return sampled


def make(num_blocks=16, block_size=4, budget=16, max_num_seqs=8, max_model_len=64, chunked=True, caching=True,
         micro_batches=1, steps=1, eligible=None):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(kv, budget, max_num_seqs, max_model_len, enable_chunked_prefill=chunked,
                     num_micro_batches=micro_batches, num_scheduler_steps=steps,
                     multi_step_eligible=eligible), FakeRunner(kv)


def req(rid, prompt, max_tokens=4, **params):
    params.setdefault("ignore_eos", True)
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=[EOS])


def step(sched, runner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.run(out))


def plan(out):
    return [(c.request.request_id, c.num_new_tokens) for c in out.chunks]


def run_to_end(sched, runner, max_steps=500):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("requests did not finish")


# ---- admission -------------------------------------------------------------------------------


def test_rejections_name_the_numbers():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=32, budget=8, chunked=False)
    with pytest.raises(RequestRejected, match="empty"):
        sched.add_request(req("e", []))
    with pytest.raises(RequestRejected, match=r"5 tokens.*max_tokens \(30\).*35.*32"):
        sched.add_request(req("long", range(5), max_tokens=30))
    with pytest.raises(RequestRejected, match=r"32 tokens.*32"):
        sched.add_request(req("none", range(32), max_tokens=None))
    with pytest.raises(RequestRejected, match=r"20 tokens of KV cache \(5 blocks of 4\).*4 blocks, 16 tokens"):
        sched.add_request(req("big", range(7), max_tokens=14))
    with pytest.raises(RequestRejected, match=r"9 tokens.*max_num_batched_tokens \(8\)"):
        sched.add_request(req("chunk", range(9), max_tokens=2))
    sched.add_request(req("ok", range(8), max_tokens=9))  # 16 KV tokens: exactly the cache
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add_request(req("ok", range(3)))
    assert sched.num_waiting == 1


def test_request_that_cannot_fit_alone_is_caught_not_deadlocked():
    sched, _ = make(num_blocks=2, block_size=4, max_model_len=64)
    r = req("huge", range(12))
    with pytest.raises(RequestRejected):
        sched.add_request(r)
    sched.waiting.append(r)  # bypass check_fits: the scheduler refuses to spin on it
    with pytest.raises(AssertionError, match="check_fits"):
        sched.schedule()


# ---- budget, chunking, mixing ----------------------------------------------------------------


def test_chunked_prefill_progression_then_decode():
    sched, runner = make(budget=8)
    r = req("a", range(1, 21), max_tokens=3)
    sched.add_request(r)
    plans = []
    while sched.has_unfinished_requests():
        out, new = step(sched, runner)
        plans.append(plan(out))
        assert out.total_num_scheduled_tokens <= 8
    assert plans == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)], [("a", 1)]]
    assert r.output_token_ids == reference(range(1, 21), 3)
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv_manager.num_used_blocks == 0


def test_prefill_chunk_and_decode_share_a_step():
    sched, runner = make(budget=6)
    sched.add_request(req("a", range(1, 4), max_tokens=5))
    assert plan(step(sched, runner)[0]) == [("a", 3)]
    sched.add_request(req("b", range(10, 20), max_tokens=2))
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 5)]
    assert [c.needs_sample for c in out.chunks] == [True, False]
    assert [c.is_prefill for c in out.chunks] == [False, True]
    new = sched.update_from_output(out, runner.run(out))
    assert [r.request_id for r in new] == ["a"]
    assert plan(step(sched, runner)[0]) == [("a", 1), ("b", 5)]
    assert plan(step(sched, runner)[0]) == [("a", 1), ("b", 1)]


def test_running_requests_go_first_and_budget_is_never_exceeded():
    sched, runner = make(budget=5, num_blocks=32, max_model_len=128)
    for i in range(4):
        sched.add_request(req(f"r{i}", range(i + 1, i + 9), max_tokens=6))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert 0 < out.total_num_scheduled_tokens <= 5
        ids = [c.request.request_id for c in out.chunks]
        assert ids == sorted(ids)  # arrival order, running before waiting
        sched.update_from_output(out, runner.run(out))


def test_max_num_seqs():
    sched, runner = make(max_num_seqs=2, budget=64)
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1, 2, 3], max_tokens=2))
    assert plan(step(sched, runner)[0]) == [("r0", 3), ("r1", 3)]
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert plan(step(sched, runner)[0]) == [("r0", 1), ("r1", 1)]
    assert plan(step(sched, runner)[0]) == [("r2", 3)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched, runner = make(budget=8, chunked=False)
    sched.add_request(req("a", range(1, 5), max_tokens=3))
    step(sched, runner)
    sched.add_request(req("b", range(10, 18), max_tokens=2))  # 8 tokens: needs a whole step
    sched.add_request(req("c", range(20, 23), max_tokens=2))  # stays behind b (FCFS)
    assert plan(step(sched, runner)[0]) == [("a", 1)]
    assert plan(step(sched, runner)[0]) == [("a", 1)]  # a finishes here
    assert plan(step(sched, runner)[0]) == [("b", 8)]


def test_recompute_longer_than_a_step_is_chunked_even_without_chunked_prefill():
    sched, runner = make(num_blocks=4, block_size=4, budget=8, chunked=False, caching=False)
    a, b = req("a", range(1, 5), max_tokens=8), req("b", range(11, 15), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    plans = []
    while sched.has_unfinished_requests() and len(plans) < 50:
        plans.append(plan(step(sched, runner)[0]))
    assert b.num_preemptions == 1  # at 9 tokens, more than one step's budget
    assert [("b", 8)] in plans and plans[plans.index([("b", 8)]) + 1] == [("b", 1)]
    assert a.output_token_ids == reference(range(1, 5), 8)
    assert b.output_token_ids == reference(range(11, 15), 8)


# ---- preemption ------------------------------------------------------------------------------


def test_newest_request_is_preempted_and_recomputed():
    sched, runner = make(num_blocks=4, block_size=4, budget=16)
    a, b = req("a", range(1, 8), max_tokens=4), req("b", range(11, 18), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    assert plan(step(sched, runner)[0]) == [("a", 7), ("b", 7)]  # 2 blocks each: cache full
    assert plan(step(sched, runner)[0]) == [("a", 1), ("b", 1)]  # 8 tokens: still 2 blocks
    sched.add_request(req("c", [5, 5], max_tokens=1))
    out, _ = step(sched, runner)  # a's 9th token needs a third block
    assert out.preempted_request_ids == ["b"]
    assert plan(out) == [("a", 1)]  # c fits, but b is first in line and does not
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.kv_manager.get_block_ids("b") == []
    run_to_end(sched, runner)
    assert a.output_token_ids == reference(range(1, 8), 4)
    assert b.output_token_ids == reference(range(11, 18), 4)
    assert sched.kv_manager.num_used_blocks == 0


def test_request_preempts_itself_when_it_is_the_newest():
    sched, runner = make(num_blocks=4, block_size=4, budget=16)
    a, b = req("a", range(1, 6), max_tokens=4), req("b", range(11, 19), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # a: 5 tokens in 2 blocks, b: 8 tokens in 2 full blocks
    out, _ = step(sched, runner)  # b's 9th token needs a block, and b is the newest
    assert out.preempted_request_ids == ["b"] and plan(out) == [("a", 1)]
    assert b.output_token_ids == reference(range(11, 19), 1)  # kept across the preemption
    run_to_end(sched, runner)
    assert b.output_token_ids == reference(range(11, 19), 4)
    assert b.num_cached_tokens == 0 and b.num_preemptions == 1


# ---- abort, stop rules -----------------------------------------------------------------------


def test_abort_waiting_and_running_frees_blocks():
    sched, runner = make(max_num_seqs=1)
    a, b = req("a", range(1, 10), max_tokens=8), req("b", range(1, 10), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.kv_manager.num_used_blocks == 3
    sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert a.status is b.status is RequestStatus.FINISHED_ABORTED
    assert a.finished_time is not None
    assert sched.kv_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()
    assert sched.get_request("a") is None
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already gone: ignored


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched, runner = make()
    a = req("a", range(1, 6))
    sched.add_request(a)
    out = sched.schedule()
    sampled = runner.run(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, sampled) == []
    assert a.output_token_ids == [] and sched.kv_manager.num_used_blocks == 0


def _first_step_token(prompt):
    return next_token(list(prompt))


def test_stop_rules():
    prompt = [3, 1, 4]
    first = _first_step_token(prompt)
    sched, runner = make()
    stop_eos = Request("eos", prompt, SamplingParams(max_tokens=5), eos_token_ids=[first])
    ignore = Request("ignore", prompt, SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=[first])
    stop_ids = Request("ids", prompt, SamplingParams(max_tokens=5, stop_token_ids=[first]))
    min_tok = Request("min", prompt, SamplingParams(max_tokens=2, min_tokens=2), eos_token_ids=[first])
    for r in (stop_eos, ignore, stop_ids, min_tok):
        sched.add_request(r)
    _, new = step(sched, runner)
    assert {r.request_id for r in new} == {"eos", "ignore", "ids", "min"}
    assert stop_eos.status is RequestStatus.FINISHED_STOPPED and stop_eos.stop_reason == first
    assert stop_ids.status is RequestStatus.FINISHED_STOPPED and stop_ids.stop_reason == first
    assert ignore.status is min_tok.status is RequestStatus.RUNNING
    run_to_end(sched, runner)
    assert ignore.status is RequestStatus.FINISHED_LENGTH and ignore.num_output_tokens == 2
    assert min_tok.status is RequestStatus.FINISHED_LENGTH and min_tok.num_output_tokens == 2


def test_context_length_finishes_a_request_without_max_tokens():
    sched, runner = make(max_model_len=12, num_blocks=8)
    r = req("a", range(1, 9), max_tokens=None)
    sched.add_request(r)
    run_to_end(sched, runner)
    assert r.num_tokens == 12 and r.status is RequestStatus.FINISHED_LENGTH


# ---- prefix cache and n > 1 --------------------------------------------------------------------


def test_sibling_waits_for_leader_prompt_then_shares_its_blocks():
    sched, runner = make(budget=8, num_blocks=16)
    prompt = list(range(1, 20))  # 19 tokens: 4 full blocks, last token computed by each
    leader = req("s0", prompt, max_tokens=3)
    sibling = req("s1", prompt, max_tokens=3)
    sibling.prefix_leader = leader
    other = req("x", [7, 7], max_tokens=3)
    for r in (leader, sibling, other):
        sched.add_request(r)
    assert plan(step(sched, runner)[0]) == [("s0", 8)]
    assert [r.request_id for r in sched.waiting] == ["s1", "x"]
    assert plan(step(sched, runner)[0]) == [("s0", 8)]
    assert plan(step(sched, runner)[0]) == [("s0", 3), ("x", 2)]  # s1 skipped, x goes
    out = sched.schedule()
    assert plan(out) == [("s0", 1), ("x", 1), ("s1", 3)]  # 16 of 19 tokens from the cache
    assert out.chunks[2].start_position == 16 and out.chunks[2].needs_sample
    assert sibling.num_cached_tokens == 16 and sibling.first_scheduled_time is not None
    assert sibling in sched.update_from_output(out, runner.run(out))
    kv = sched.kv_manager
    assert kv.get_block_ids("s1")[:4] == kv.get_block_ids("s0")[:4]
    assert kv.prefix_cache_hits == 16
    run_to_end(sched, runner)
    assert sibling.output_token_ids == leader.output_token_ids == reference(prompt, 3)


def test_sibling_of_an_aborted_leader_runs_on_its_own():
    sched, runner = make(budget=4)
    leader, sibling = req("s0", range(1, 10)), req("s1", range(1, 10))
    sibling.prefix_leader = leader
    sched.add_request(leader)
    sched.add_request(sibling)
    step(sched, runner)
    sched.finish_requests("s0", RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched, runner)
    assert plan(out) == [("s1", 4)]
    assert sibling.num_cached_tokens == 4  # the block the leader completed before it went


# ---- simulation ------------------------------------------------------------------------------


def _check_invariants(sched, out, micro_batch=0, in_flight=()):
    kv = sched.kv_manager
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.chunks) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
    assert all(c.num_new_tokens >= 1 for c in out.chunks)
    assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
    assert all(c.request.micro_batch == micro_batch for c in out.chunks)
    # A request is never in two steps at once, and a step in flight loses none of its blocks.
    flying = {c.request.request_id for o in in_flight for c in o.chunks}
    assert not flying & {c.request.request_id for c in out.chunks}
    assert not flying & set(out.preempted_request_ids)
    if sched.num_micro_batches == 1:
        assert not out.is_empty or not sched.has_unfinished_requests()
    holders = {}
    for r in sched.running:
        for b in kv.get_block_ids(r.request_id):
            holders[b] = holders.get(b, 0) + 1
    for r in sched.waiting:
        assert kv.get_block_ids(r.request_id) == []
    assert [b.ref_cnt for b in kv.block_pool.blocks] == [holders.get(i, 0) for i in range(kv.num_blocks)]
    assert kv.num_used_blocks == len(holders)


def _simulate(seed, micro_batches=1, steps=1):
    """Random arrivals, n > 1 siblings, aborts, a tight cache. With ``micro_batches`` > 1 it
    runs like the pipeline-parallel engine: a step per idle micro-batch is scheduled before
    the oldest step in flight is run and applied (steps run in the order scheduled)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(6, 14)
    capacity = num_blocks * block_size
    chunked = rng.random() < 0.75
    budget = rng.randint(3, 24) if chunked else rng.randint(12, 24)
    # Multi-step rounds for the requests whose number (r<number>[.<sibling>]) is even (the others, the
    # engine's ineligible ones, keep rounds to one step while they run).
    sched, runner = make(num_blocks, block_size, budget, rng.randint(1, 6), capacity + 1, chunked,
                         caching=rng.random() < 0.85, micro_batches=micro_batches, steps=steps,
                         eligible=lambda r: int(r.request_id.split(".")[0][1:]) % 2 == 0)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))] for _ in range(3)]

    arrivals = []  # (step, requests)
    for i in range(rng.randint(6, 16)):
        prompt = rng.choice(prefixes)[: rng.randint(1, 10)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))]
        prompt = prompt[: min(capacity - 1, budget)]
        max_tokens = rng.randint(1, min(12, capacity + 1 - len(prompt)))
        params = dict(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
        group = [req(f"r{i}", prompt, **params)]
        for k in range(1, rng.choice([1, 1, 1, 2, 3])):  # n > 1 siblings
            sibling = req(f"r{i}.{k}", prompt, **params)
            sibling.prefix_leader = group[0]
            group.append(sibling)
        arrivals.append((rng.randint(0, 25), group))

    everyone, aborted = [], set()
    in_flight = deque()
    multi_step_rounds = 0
    for t in range(5000):
        for when, group in arrivals:
            if when == t:
                for r in group:
                    sched.add_request(r)
                    everyone.append(r)
        if t > 25 and not sched.has_unfinished_requests():
            break
        busy = {mb for mb, _ in in_flight}
        for mb in range(micro_batches):
            if mb not in busy:
                out = sched.schedule(mb)
                _check_invariants(sched, out, mb, [o for _, o in in_flight])
                in_flight.append((mb, out))
        _, out = in_flight.popleft()
        multi_step_rounds += out.num_steps > 1
        sched.update_from_output(out, runner.run(out))
        if everyone and rng.random() < 0.03:
            victim = rng.choice(everyone)
            if not victim.is_finished:
                aborted.add(victim.request_id)
            sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
    else:
        raise AssertionError(f"seed {seed}: requests did not finish")

    for r in everyone:
        assert r.is_finished
        if r.request_id in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            continue
        eos = None if r.sampling_params.ignore_eos else EOS
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens, eos), (seed, r.request_id)
    assert sched.kv_manager.num_used_blocks == 0
    assert sched.num_running == sched.num_waiting == 0
    sched.multi_step_rounds = multi_step_rounds
    return sched


def test_simulation_matches_running_alone():
    preemptions = hits = 0
    for seed in range(60):
        sched = _simulate(seed)
        preemptions += sched.num_preemptions
        hits += sched.kv_manager.prefix_cache_hits
    # The workload is small enough to be fast and tight enough to exercise the hard paths.
    assert preemptions > 20 and hits > 100


def test_pipelined_micro_batches_match_running_alone():
    preemptions = hits = 0
    for seed in range(60):
        sched = _simulate(seed, micro_batches=2)
        preemptions += sched.num_preemptions
        hits += sched.kv_manager.prefix_cache_hits
    assert preemptions > 20 and hits > 100


def test_micro_batches_split_requests_and_schedule_apart():
    sched, runner = make(micro_batches=2)
    reqs = [req(f"r{i}", range(1 + i, 5 + i)) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    assert [r.micro_batch for r in reqs] == [0, 1, 0, 1]  # the least loaded, in turn
    first, second = sched.schedule(0), sched.schedule(1)
    assert plan(first) == [("r0", 4), ("r2", 4)] and plan(second) == [("r1", 4), ("r3", 4)]
    sched.update_from_output(first, runner.run(first))
    assert plan(sched.schedule(0)) == [("r0", 1), ("r2", 1)]
    sched.finish_requests(["r0", "r2"], RequestStatus.FINISHED_ABORTED)
    late = req("late", [3, 3])
    sched.add_request(late)
    assert late.micro_batch == 0  # micro-batch 0 emptied: the newcomer balances the load


def test_multi_step_simulation_matches_running_alone():
    """Rounds of up to 4 decode steps where every running request is eligible and none waits:
    the same tokens as alone, each lookahead slot written once, every block back at the end."""
    preemptions = rounds = 0
    for seed in range(60):
        sched = _simulate(seed, steps=4)
        preemptions += sched.num_preemptions
        rounds += sched.multi_step_rounds
    assert preemptions > 10 and rounds > 30


def test_multi_step_rounds_only_when_every_running_request_decodes_and_nothing_waits():
    sched, runner = make(num_blocks=32, budget=16, steps=4, eligible=lambda r: r.request_id != "sampled")
    a = req("a", [1, 2, 3], max_tokens=20)
    sched.add_request(a)
    out, _ = step(sched, runner)  # the prefill: one step
    assert out.num_steps == 1 and a.num_output_tokens == 1
    out, _ = step(sched, runner)
    assert out.num_steps == 4 and a.num_output_tokens == 5 and a.num_computed_tokens == 7
    sched.add_request(req("b", [4, 5], max_tokens=20))
    out, _ = step(sched, runner)  # b waits: one step, which admits it
    assert out.num_steps == 1 and plan(out) == [("a", 1), ("b", 2)]
    out, _ = step(sched, runner)
    assert out.num_steps == 4 and a.num_output_tokens == 10
    sched.add_request(req("sampled", [6], max_tokens=20))
    step(sched, runner)
    out, _ = step(sched, runner)  # an ineligible request runs: one step
    assert out.num_steps == 1 and a.num_output_tokens == 12
    sched.finish_requests(["sampled"], RequestStatus.FINISHED_ABORTED)
    run_to_end(sched, runner)
    assert a.output_token_ids == reference([1, 2, 3], 20)
    # Never past a length limit: 2 tokens left, a round of 2.
    c = req("c", [7, 8], max_tokens=3)
    sched.add_request(c)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.num_steps == 2 and c.is_finished and c.output_token_ids == reference([7, 8], 3)


def test_multi_step_round_stops_at_eos_and_falls_back_without_lookahead_room():
    prompt = [3, 1, 4]
    ref = reference(prompt, 20, eos=EOS)
    assert EOS in ref  # the fake model ends this one early
    sched, runner = make(num_blocks=32, steps=8, eligible=lambda r: True)
    r = req("r", prompt, max_tokens=20, ignore_eos=False)
    sched.add_request(r)
    run_to_end(sched, runner)
    assert r.output_token_ids == ref and r.status is RequestStatus.FINISHED_STOPPED
    assert sched.kv_manager.num_used_blocks == 0
    # Three usable blocks of 4 for two requests: after their prompts and first tokens (a block
    # each), a round of 4 needs a second block for each; a gets the last one, b cannot, and the
    # round falls back to one step (b's next token fits its own block).
    sched, runner = make(num_blocks=3, block_size=4, steps=4, eligible=lambda r: True)
    assert sched.kv_manager.num_usable_blocks == 3
    a, b = req("a", [1, 2], max_tokens=6), req("b", [3, 4], max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.num_steps == 1 and not out.preempted_request_ids
    run_to_end(sched, runner)
    assert a.output_token_ids == reference([1, 2], 6) and b.output_token_ids == reference([3, 4], 6)
    assert sched.kv_manager.num_used_blocks == 0


def test_a_round_that_does_not_fit_preempts_nobody_a_single_step_would_not():
    """a takes its lookahead block, b's next token then finds no room: the round falls back to
    one step and a gives its lookahead back, so b's token fits as it does one step at a time
    (before, b was preempted there)."""
    for steps in (1, 4):
        sched, runner = make(num_blocks=3, block_size=4, steps=steps, eligible=lambda r: True)
        a, b = req("a", [1, 2], max_tokens=6), req("b", [3, 4, 5, 6], max_tokens=4)
        sched.add_request(a)
        sched.add_request(b)
        step(sched, runner)
        out, _ = step(sched, runner)
        assert out.num_steps == 1 and out.preempted_request_ids == [], steps
        assert len(sched.kv_manager.get_block_ids("a")) == 1  # its lookahead given back
        run_to_end(sched, runner)
        assert a.output_token_ids == reference([1, 2], 6) and b.output_token_ids == reference([3, 4, 5, 6], 4)
        assert sched.kv_manager.num_used_blocks == 0


def test_async_placeholders_plan_the_next_step_and_resolve_in_order():
    """Async scheduling's bookkeeping, torch-free: a committed step leaves a placeholder per
    sampling chunk, the next step decodes it, a request at its length limit is not planned
    past it, and the collected tokens replace the placeholders in order."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    b = Request("b", [6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    sched.commit_in_flight(first)
    assert [(c.request.num_computed_tokens, c.request.num_output_placeholders) for c in first.chunks] == [(5, 1), (3, 1)]
    second = sched.schedule()  # planned on the placeholders: one decode each, at the next position
    assert [(c.request.request_id, c.start_position, c.num_new_tokens, c.needs_sample) for c in second.chunks] == [
        ("a", 5, 1, True), ("b", 3, 1, True)]
    sched.commit_in_flight(second)
    assert sched.update_from_output(first, {"a": 10, "b": 20}, committed=True) == [a, b]
    assert (a.output_token_ids, a.num_output_placeholders, a.num_computed_tokens) == ([10], 1, 6)
    # a's second (last allowed) token is in flight: the third step plans only b.
    third = sched.schedule()
    assert [c.request.request_id for c in third.chunks] == ["b"]
    sched.commit_in_flight(third)
    sched.update_from_output(second, {"a": 11, "b": 21}, committed=True)
    assert a.is_finished and a.output_token_ids == [10, 11] and kv.get_block_tables("a") == [[]]
    sched.update_from_output(third, {"b": 22}, committed=True)
    assert b.output_token_ids == [20, 21, 22] and b.num_output_placeholders == 0 and b.num_computed_tokens == 5
    assert not sched.may_preempt()
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert kv.num_used_blocks == 0


def test_may_preempt_when_the_next_step_outgrows_the_free_pool():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    reqs = [Request(f"r{i}", list(range(1 + 10 * i, 9 + 10 * i)), SamplingParams(max_tokens=4, ignore_eos=True))
            for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    first = sched.schedule()
    assert not sched.may_preempt()  # nothing committed yet: 8 tokens each, in their 2 blocks
    sched.commit_in_flight(first)  # each one's 9th token (a placeholder) needs a third block
    assert kv.num_free_blocks == 0 and sched.may_preempt()
    sched.update_from_output(first, {"r0": 5, "r1": 6}, committed=True)
    sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert not sched.may_preempt()
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert kv.num_used_blocks == 0
