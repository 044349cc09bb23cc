"""Speculative decoding's bookkeeping, torch-free: the n-gram drafter, the adaptive policy,
and the scheduler / KV manager with drafts (lookahead slots, accepted runs, rollback of
rejected drafts, stops in the middle of a run), checked against running without drafts.

The fake model is ``fake_model``'s (shared with ``test_scheduler``): each token is a function of the whole sequence,
read back from a simulated paged KV store, so a draft's KV that survives its rejection, or
a rejected token hashed into the prefix cache, changes the generated tokens.
"""
import random

import pytest

from kvserve.config import ConfigError
from kvserve.kv_manager import KVCacheManager
from kvserve.request import Request, RequestStatus, SamplingParams
from kvserve.scheduler import Scheduler
from kvserve.speculative import SpeculativeConfig, Speculator, parse_speculative_config
from kvserve.speculative.ngram import NgramDrafter
from kvserve.speculative.verify import accept_run

from fake_model import EOS, VOCAB, next_token, paged_slot, reference

class SpecFakeRunner:
    """Writes every scheduled token (drafts included) into its paged slot, then, like a
    verify pass, computes the target's token at each drafted position from what the store
    holds, and returns the accepted run."""

    def __init__(self, kv):
        self.kv = kv
        self.block_size = kv.block_size
        self.store = {}

    def _slot(self, block_ids, pos):
        return paged_slot(block_ids, self.block_size, pos)

    def run(self, out):
        for c in out.chunks:
            tokens = c.request.all_token_ids + c.spec_token_ids
            assert c.start_position + c.num_new_tokens <= len(tokens)
            assert len(c.block_ids) * self.block_size >= c.start_position + c.num_new_tokens
            for pos in range(c.start_position, c.start_position + c.num_new_tokens):
                self.store[self._slot(c.block_ids, pos)] = tokens[pos]
        sampled = {}
        for c in out.chunks:
            if c.needs_sample:
                end = c.start_position + c.num_new_tokens
                k = len(c.spec_token_ids)
                target = [next_token([self.store[self._slot(c.block_ids, p)] for p in range(n)])
                          for n in range(end - k, end + 1)]
                sampled[c.request.request_id] = accept_run(c.spec_token_ids, target)
        return sampled


def make(num_blocks=16, block_size=4, budget=16, max_num_seqs=8, max_model_len=64, caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(kv, budget, max_num_seqs, max_model_len), SpecFakeRunner(kv)


def req(rid, prompt, max_tokens=4, **params):
    params.setdefault("ignore_eos", True)
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=[EOS])


def oracle_drafts(request, k, rng, p_wrong=0.3):
    """The true continuation, with a wrong token somewhere now and then."""
    seq = list(request.all_token_ids)
    drafts = []
    for _ in range(k):
        tok = next_token(seq)
        if rng.random() < p_wrong:
            tok = (tok + 1) % VOCAB
        drafts.append(tok)
        seq.append(tok)
    return drafts


# ---- drafter, verification, config -------------------------------------------------------------


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    d = NgramDrafter(min_n=2, max_n=3, k=3)
    #        0  1  2  3  4  5  6  7  8  9 10
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7]
    # The 3-gram [5, 6, 7] occurs at 0: propose what followed it.
    assert d.propose(seq) == [8, 9, 1]
    # Only the 2-gram [6, 7] matches; its most recent earlier occurrence is at 6.
    assert d.propose([9, 6, 7, 2, 4, 6, 7]) == [2, 4, 6]
    assert d.propose([1, 2, 3, 4]) == []  # no earlier occurrence
    # A run or a repeated span near the end: the copy overlaps itself (period = distance).
    assert d.propose([3, 3, 3, 3], k=2) == [3, 3]
    assert d.propose([9, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert d.propose([5, 6, 7, 1, 2, 7, 1, 2], k=4) == [7, 1, 2, 7]
    assert d.propose(seq, k=1) == [8]
    # Token ids above one byte: a byte-level match across token boundaries is not a match.
    assert d.propose([0x0100, 0x0200, 0x01000000, 0x02000000, 7, 0x0100, 0x0200]) == [0x01000000, 0x02000000, 7]
    assert d.propose([0x00010000, 0x00020000, 5, 1, 2]) == []


def test_accept_run_is_the_longest_matching_prefix_plus_the_targets_token():
    assert accept_run([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_run([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_run([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_run([], [3]) == [3]


def test_speculative_config_parsing_and_errors():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg == SpeculativeConfig(num_speculative_tokens=3)
    assert parse_speculative_config(None) is None
    for bad, words in [("{", "JSON"), ("[1]", "JSON object"), ({"num_speculative_tokens": 2}, "method"),
                       ({"method": "medusa"}, "unknown speculative method"),
                       ({"method": "ngram", "k": 2}, "unknown speculative_config key"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": "4"}, "integer"),
                       ({"method": "ngram", "prompt_lookup_min": 5}, "prompt_lookup_min")]:
        with pytest.raises(ConfigError, match=words):
            parse_speculative_config(bad)


def _decoding(rid, tokens):
    r = req(rid, tokens, max_tokens=100)
    r.num_computed_tokens = len(tokens) - 1
    return r


def test_policy_skips_large_batches_and_backs_off_on_rejection():
    cfg = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=2, max_backoff_steps=4)
    spec = Speculator(cfg, NgramDrafter(2, 2, 2))
    seq = [1, 2, 3, 1, 2]
    a, b, c = (_decoding(x, seq) for x in "abc")
    assert spec.propose([a, b, c]) == {}  # batch too large
    assert spec.propose([a, b]) == {"a": [3, 1], "b": [3, 1]}
    # Penalties would need per-draft replay: no drafts.
    pen = _decoding("pen", seq)
    pen.sampling_params.repetition_penalty = 1.2
    assert spec.propose([pen]) == {}
    # Nothing accepted: skip 1 step, then 2, then 4 (the cap), until a draft is accepted.
    skipped = []
    for accepted in (0, 0, 0, 0, 1):
        spec.observe("a", 2, accepted)
        n = 0
        while not spec.propose([a]):
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 4, 0]
    assert spec.stats.num_draft_tokens == 10 and spec.stats.num_accepted_tokens == 1
    assert spec.stats.mean_accepted_length == pytest.approx(1.2)


# ---- scheduler and KV manager with drafts -------------------------------------------------------


def test_drafts_take_lookahead_slots_and_rejected_ones_are_rolled_back():
    sched, runner = make(block_size=4, budget=16)
    r = req("a", [1, 2, 3], max_tokens=20)
    sched.add_request(r)
    one_step(sched, runner)  # prefill + first token: 4 tokens, 1 block
    assert r.num_computed_tokens == 3 and r.num_tokens == 4
    truth = reference([1, 2, 3], 20)
    drafts = [truth[1], truth[2], (truth[3] + 1) % VOCAB, 5, 6]  # third one wrong
    out = sched.schedule(drafts={"a": drafts})
    (chunk,) = out.chunks
    assert chunk.num_new_tokens == 6 and chunk.spec_token_ids == drafts
    # Room for the last token and five drafts: positions 3..8, three blocks.
    assert len(chunk.block_ids) == 3
    new = sched.update_from_output(out, runner.run(out))
    assert new == [r] and r.output_token_ids == truth[:4]  # two drafts + the target's token
    # KV holds positions 0..5 (the prompt, the first token, two accepted drafts): 2 blocks.
    assert r.num_computed_tokens == 6 and r.num_tokens == 7
    assert len(sched.kv_manager.get_block_ids("a")) == 2
    # Only the first block (positions 0..3, all accepted tokens) is in the prefix cache.
    assert len(r.block_hashes) == 1
    run_to_end(sched, runner)
    assert r.output_token_ids == truth and sched.kv_manager.num_used_blocks == 0


def one_step(sched, runner):
    out = sched.schedule()
    return sched.update_from_output(out, runner.run(out))


def run_to_end(sched, runner, drafter=None, max_steps=500):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        drafts = {}
        if drafter is not None:
            drafts = {r.request_id: drafter(r) for r in sched.running if r.num_tokens - r.num_computed_tokens == 1}
        out = sched.schedule(drafts=drafts)
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        sched.update_from_output(out, runner.run(out))
    raise AssertionError("requests did not finish")


def test_drafts_never_pass_max_tokens_the_context_or_the_budget():
    sched, runner = make(budget=4, max_model_len=12)
    r = req("a", [1, 2, 3], max_tokens=4)
    sched.add_request(r)
    one_step(sched, runner)
    truth = reference([1, 2, 3], 4)
    out = sched.schedule(drafts={"a": truth[1:] + [1, 1, 1]})
    # 3 tokens may still come: the last real token + 2 drafts (the third is sampled).
    assert out.chunks[0].spec_token_ids == truth[1:3]
    sched.update_from_output(out, runner.run(out))
    assert r.output_token_ids == truth and r.status is RequestStatus.FINISHED_LENGTH
    # The budget caps drafts too: 4 tokens per step, so at most 3 drafts.
    sched, runner = make(budget=4)
    r = req("b", [1, 2, 3], max_tokens=20)
    sched.add_request(r)
    one_step(sched, runner)
    assert len(sched.schedule(drafts={"b": [9] * 8}).chunks[0].spec_token_ids) == 3
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)


@pytest.mark.parametrize("rule", ["eos", "stop_token", "max_tokens"])
def test_a_stop_inside_an_accepted_run_ends_the_request_there(rule):
    prompt = [3, 1, 4]
    truth = reference(prompt, 12)
    stop_at = 3  # the 4th output token stops it; drafts run past it
    params = {"eos": dict(ignore_eos=False), "stop_token": dict(stop_token_ids=[truth[stop_at]]),
              "max_tokens": {}}[rule]
    eos = [truth[stop_at]] if rule == "eos" else [EOS]
    if truth[stop_at] in truth[:stop_at]:
        pytest.skip("fake model repeats the stop token earlier")
    sched, runner = make()
    r = Request("a", prompt, SamplingParams(max_tokens=stop_at + 1 if rule == "max_tokens" else 12,
                                            **params), eos_token_ids=eos)
    sched.add_request(r)
    one_step(sched, runner)
    out = sched.schedule(drafts={"a": truth[1:8]})
    if rule != "max_tokens":
        assert len(out.chunks[0].spec_token_ids) == 7
    seen = []
    sched.update_from_output(out, runner.run(out), on_token=lambda q, j: seen.append(j) and False)
    assert r.output_token_ids == truth[:stop_at + 1]
    assert r.status is (RequestStatus.FINISHED_LENGTH if rule == "max_tokens" else RequestStatus.FINISHED_STOPPED)
    assert seen == list(range(stop_at))  # every appended token was shown to the detokenizer
    assert sched.kv_manager.num_used_blocks == 0


def test_a_stop_string_hook_ends_the_run_at_its_token():
    prompt = [3, 1, 4]
    truth = reference(prompt, 12)
    sched, runner = make()
    r = req("a", prompt, max_tokens=12)
    sched.add_request(r)
    one_step(sched, runner)
    out = sched.schedule(drafts={"a": truth[1:6]})
    sched.update_from_output(out, runner.run(out), on_token=lambda q, j: j == 2)
    assert r.output_token_ids == truth[:4] and r.status is RequestStatus.FINISHED_STOPPED


def _simulate(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    capacity = rng.randint(8, 24)
    num_blocks = -(-capacity // block_size) + rng.randint(0, 6)
    budget = rng.randint(4, 16)
    sched, runner = make(num_blocks, block_size, budget, rng.randint(1, 6), capacity + 1,
                         caching=rng.random() < 0.85)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    requests, arrivals = [], []
    for i in range(rng.randint(4, 12)):
        prompt = rng.choice(prefixes)[: rng.randint(1, 10)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))]
        prompt = prompt[: min(capacity - 1, budget)]
        max_tokens = rng.randint(1, min(12, capacity + 1 - len(prompt)))
        r = req(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
        requests.append(r)
        arrivals.append((rng.randint(0, 20), r))
    drafter = lambda r: oracle_drafts(r, rng.randint(0, 5), rng)
    for t in range(3000):
        for when, r in arrivals:
            if when == t:
                sched.add_request(r)
        if t > 20 and not sched.has_unfinished_requests():
            break
        drafts = {r.request_id: drafter(r) for r in sched.running if r.num_tokens - r.num_computed_tokens == 1}
        out = sched.schedule(drafts=drafts)
        assert out.total_num_scheduled_tokens <= budget
        for c in out.chunks:
            kv_tokens = c.start_position + c.num_new_tokens
            assert len(c.block_ids) == sched.kv_manager.num_blocks_for(kv_tokens)
        sched.update_from_output(out, runner.run(out))
        for r in sched.running:
            # Rollback leaves no block beyond the ones holding computed tokens (+ this step's).
            assert len(sched.kv_manager.get_block_ids(r.request_id)) <= sched.kv_manager.num_blocks_for(r.num_tokens)
    else:
        raise AssertionError(f"seed {seed}: requests did not finish")
    for r in requests:
        eos = None if r.sampling_params.ignore_eos else EOS
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params.max_tokens, eos), (seed, r.request_id)
    assert sched.kv_manager.num_used_blocks == 0
    return sched


def test_simulation_with_drafts_matches_running_alone():
    preemptions = hits = 0
    for seed in range(60):
        sched = _simulate(seed)
        preemptions += sched.num_preemptions
        hits += sched.kv_manager.prefix_cache_hits
    assert preemptions > 10 and hits > 50
