"""Sampler: exact logits processing, statistical agreement of the random paths with plain-torch
reference distributions, per-request seeds, logprobs."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvserve.executor.runner import RequestState
from kvserve.request import Request, SamplingParams
import kvserve.sampler as sampler_module
from kvserve.sampler import Sampler, apply_top_k_top_p, argmax_suffices, build_sampling_metadata, make_generator

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
_ids = itertools.count()


def make_request(prompt=(0,), output=(), eos=(), generator=None, **params) -> RequestState:
    """A sampler row as the runner keeps it (sampler.SamplingRow)."""
    return RequestState(f"r{next(_ids)}", list(prompt), SamplingParams(**params), list(eos), generator,
                        output_token_ids=list(output))


def sample(logits: torch.Tensor, requests: list[Request]):
    md = build_sampling_metadata(requests, logits.shape[-1], logits.device)
    return Sampler()(logits, md)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


# ---- plain-torch references (written independently of the sampler's vectorised code) ----

def ref_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    keep = torch.full_like(logits, float("-inf"))
    vals, idx = torch.topk(logits, k)
    return keep.scatter(0, idx, vals)


def ref_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    # HF's TopPLogitsWarper: ascending sort, drop tokens whose cumulative mass <= 1 - p.
    sorted_logits, idx = torch.sort(logits)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= 1 - p
    drop[-1] = False
    return logits.masked_fill(drop.scatter(0, idx, drop), float("-inf"))


def ref_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def ref_penalties(logits, prompt, output, rep=1.0, freq=0.0, pres=0.0) -> torch.Tensor:
    out = logits.clone()
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    for tok in set(output):
        out[tok] -= freq * output.count(tok) + pres
    return out


def ref_distribution(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                     penalties=None) -> torch.Tensor:
    x = logits.double()
    if penalties is not None:
        x = ref_penalties(x, **penalties)
    x = x / temperature
    if top_k:
        x = ref_top_k(x, top_k)
    if top_p < 1.0:
        x = ref_top_p(x, top_p)
    if min_p:
        x = ref_min_p(x, min_p)
    return x.softmax(-1)


STAT_CASES = [
    dict(temperature=0.7),
    dict(temperature=1.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.1),
    dict(temperature=1.0, penalties=dict(prompt=[0, 1], output=[2, 3, 3, 3],
                                         rep=1.5, freq=0.4, pres=0.5)),
]


@pytest.mark.parametrize("device", DEVICES)
def test_batched_sampling_matches_reference_distributions(device):
    """All cases share one batch (rows interleaved, plus greedy rows), so the per-row
    parameter vectors are exercised, not one configuration at a time."""
    torch.manual_seed(0)
    vocab = 12
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    samples_per_case = 20_000
    cases = STAT_CASES + [dict(temperature=0.0)]  # a greedy row group in the same batch

    requests, case_of_row = [], []
    for _ in range(samples_per_case):
        for c, case in enumerate(cases):
            params = {k: v for k, v in case.items() if k != "penalties"}
            pen = case.get("penalties")
            if pen:
                params.update(repetition_penalty=pen["rep"], frequency_penalty=pen["freq"],
                              presence_penalty=pen["pres"])
                requests.append(make_request(prompt=pen["prompt"], output=pen["output"], **params))
            else:
                requests.append(make_request(**params))
            case_of_row.append(c)
    logits = base.to(device).expand(len(requests), vocab).contiguous()
    tokens = sample(logits, requests).sampled_token_ids.cpu()
    case_of_row = torch.tensor(case_of_row)

    assert (tokens[case_of_row == len(cases) - 1] == base.argmax()).all()
    plain = base.double().softmax(-1)
    for c, case in enumerate(STAT_CASES):
        ref = ref_distribution(base, **case).float()
        # The case must be distinguishable from plain sampling, or agreement proves nothing.
        assert total_variation(ref, plain.float()) > 0.05, case
        counts = torch.bincount(tokens[case_of_row == c], minlength=vocab).float()
        empirical = counts / counts.sum()
        assert total_variation(empirical, ref) < 0.03, (case, empirical, ref)
        excluded = ref == 0
        assert counts[excluded].sum() == 0, (case, "sampled a token the reference excludes")


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_costs_no_extra_tensors(device):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2)).to(device)
    requests = [make_request(temperature=0.0) for _ in range(5)]
    md = build_sampling_metadata(requests, 40, device)
    assert md.all_greedy and md.no_penalties and md.no_top_k and md.no_top_p and md.no_min_p
    assert md.temperature is None and md.logit_bias is None and md.num_logprobs is None
    before = logits.clone()
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None
    assert torch.equal(logits, before), "the sampler must not modify its input"


def _run_seeded(steps_logits, batch_builder, device) -> list[int]:
    """Sample the target row for each step's logits; ``batch_builder`` places it in a batch
    and returns (requests, target_row)."""
    target = make_request(temperature=1.0, top_p=0.95, generator=make_generator(1234, device))
    tokens = []
    for step, row_logits in enumerate(steps_logits):
        requests, row = batch_builder(target, step)
        logits = torch.randn(len(requests), row_logits.numel(), device=device)
        logits[row] = row_logits
        tokens.append(sample(logits, requests).sampled_token_ids[row].item())
        target.output_token_ids.append(tokens[-1])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_batch(device):
    torch.manual_seed(3)
    steps = [torch.randn(50, device=device) for _ in range(25)]

    alone = _run_seeded(steps, lambda t, s: ([t], 0), device)

    def crowded(target, step):
        # Unseeded neighbours, a differently seeded neighbour and greedy rows; the target
        # moves around the batch from step to step.
        others = [make_request(temperature=1.0),
                  make_request(temperature=0.9, generator=make_generator(step, device)),
                  make_request(temperature=0.0),
                  make_request(temperature=1.3, top_k=5)]
        row = step % (len(others) + 1)
        return others[:row] + [target] + others[row:], row

    torch.manual_seed(99)  # a different state of the shared generator must not matter
    in_crowd = _run_seeded(steps, crowded, device)
    assert alone == in_crowd
    other_seed = make_request(temperature=1.0, top_p=0.95, generator=make_generator(4321, device))
    differs = [sample(s.unsqueeze(0), [other_seed]).sampled_token_ids.item() for s in steps]
    assert differs != alone, "a different seed should give a different sequence"


def test_the_runner_seeds_each_seeded_request_its_own_generator():
    from kvserve.executor.step import NewRequestData

    def state(seed):
        data = NewRequestData(f"r{next(_ids)}", [0], SamplingParams(temperature=1.0, seed=seed), [], seed)
        return RequestState.for_new_request(data, torch.device("cpu"))

    req = state(7)
    assert req.generator is not None and state(None).generator is None
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(5))
    first = [sample(logits, [req]).sampled_token_ids.item() for _ in range(10)]
    again = state(7)
    assert first == [sample(logits, [again]).sampled_token_ids.item() for _ in range(10)]


def test_logit_bias_exact_and_decides_greedy_choice():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.5]])
    requests = [make_request(temperature=0.0, logit_bias={0: 5.0, 2: -1.5}),
                make_request(temperature=0.0)]
    md = build_sampling_metadata(requests, 4, "cpu")
    processed = Sampler.apply_logits_processors(logits, md)
    assert torch.equal(processed, torch.tensor([[6.0, 2.0, 1.5, 0.5], [1.0, 2.0, 3.0, 0.5]]))
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0, 2]
    # A strongly negative bias excludes a token from random sampling.
    torch.manual_seed(0)
    rows = [make_request(temperature=1.0, logit_bias={2: -100.0}) for _ in range(2000)]
    tokens = sample(logits[:1].expand(2000, 4), rows).sampled_token_ids
    assert not (tokens == 2).any()


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0, 2.0]] * 4)
    eos, stop = [2], [3]
    requests = [
        make_request(temperature=0.0, min_tokens=3, stop_token_ids=stop, eos=eos, output=[5]),
        make_request(temperature=0.0, min_tokens=3, stop_token_ids=stop, eos=eos, output=[5, 5, 5]),
        make_request(temperature=0.0, min_tokens=3, stop_token_ids=stop, eos=eos, ignore_eos=True),
        make_request(temperature=1.0, min_tokens=2, stop_token_ids=stop, eos=eos, output=[1]),
    ]
    md = build_sampling_metadata(requests, 6, "cpu")
    processed = Sampler.apply_logits_processors(logits, md)
    inf = float("-inf")
    assert torch.equal(processed, torch.tensor([[0.0, 1.0, inf, inf, 7.0, 2.0],
                                                [0.0, 1.0, 9.0, 8.0, 7.0, 2.0],
                                                [0.0, 1.0, 9.0, inf, 7.0, 2.0],
                                                [0.0, 1.0, inf, inf, 7.0, 2.0]]))
    tokens = Sampler()(logits, md).sampled_token_ids.tolist()
    assert tokens[:3] == [4, 2, 2]
    assert tokens[3] not in (2, 3)


def test_penalties_exact_on_small_logits():
    logits = torch.tensor([[2.0, -1.0, 4.0, -3.0, 0.5, 1.0]])
    prompt, output = [0, 1], [2, 3, 3]
    req = make_request(prompt=prompt, output=output, temperature=0.0, repetition_penalty=2.0,
                       frequency_penalty=0.5, presence_penalty=0.25)
    md = build_sampling_metadata([req], 6, "cpu")
    processed = Sampler.apply_logits_processors(logits, md)
    # Repetition: 2/2, -1*2, 4/2, -3*2 on seen tokens 0-3; then output token 2 once and
    # token 3 twice pay frequency (0.5 each) plus presence (0.25).
    expected = torch.tensor([[1.0, -2.0, 2.0 - 0.5 - 0.25, -6.0 - 1.0 - 0.25, 0.5, 1.0]])
    assert torch.allclose(processed, expected, atol=0, rtol=0)
    assert torch.allclose(processed[0], ref_penalties(logits[0], prompt, output, 2.0, 0.5, 0.25))
    # Rows without penalties in the same batch are untouched.
    plain = make_request(prompt=prompt, output=output, temperature=0.0)
    md2 = build_sampling_metadata([req, plain], 6, "cpu")
    both = Sampler.apply_logits_processors(logits.expand(2, 6), md2)
    assert torch.equal(both[0], expected[0]) and torch.equal(both[1], logits[0])


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_with_ranks(device):
    torch.manual_seed(4)
    logits = torch.randn(4, 30, device=device)
    requests = [make_request(temperature=0.0, logprobs=3),
                make_request(temperature=0.0),
                make_request(temperature=0.7, top_k=5, repetition_penalty=1.3, output=[1],
                             logprobs=5),
                make_request(temperature=0.0, logprobs=0, logit_bias={7: 50.0})]
    out = sample(logits, requests)
    ref = torch.log_softmax(logits.double(), -1).cpu()
    tokens = out.sampled_token_ids.tolist()
    assert out.logprobs[1] is None
    for row, n in [(0, 3), (2, 5), (3, 0)]:
        entry = out.logprobs[row]
        order = torch.argsort(ref[row], descending=True).tolist()
        assert tokens[row] in entry
        sampled = entry[tokens[row]]
        assert sampled.rank == order.index(tokens[row]) + 1
        assert {t for t in entry if entry[t].rank <= n} == set(order[:n])
        assert set(entry) == set(order[:n]) | {tokens[row]}
        for tok, lp in entry.items():
            assert lp.token_id == tok
            assert abs(lp.logprob - ref[row, tok].item()) < 1e-5
            assert lp.rank == order.index(tok) + 1
    # The bias chose token 7 but its logprob and rank are the model's own (raw) ones.
    assert tokens[3] == 7 and out.logprobs[3][7].rank == order_rank(ref[3], 7) > 1


def order_rank(row_logprobs: torch.Tensor, token: int) -> int:
    return int((row_logprobs > row_logprobs[token]).sum().item()) + 1


def test_top_p_keeps_at_least_the_top_token_and_top_k_is_exact():
    # One dominant token: top_p=0.1 must still keep it; top_k=1 is greedy.
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 200)
    torch.manual_seed(0)
    for params in (dict(top_p=0.1), dict(top_k=1), dict(min_p=1.0)):
        tokens = sample(logits, [make_request(temperature=1.0, **params) for _ in range(200)])
        assert (tokens.sampled_token_ids == 0).all(), params


def test_top_k_top_p_candidate_path_is_exact(monkeypatch):
    """The CPU path filters on the top candidates and sorts in full only rows whose nucleus
    reaches past them; kept sets must equal the plain reference row by row."""
    gen = torch.Generator().manual_seed(6)
    rows, vocab = 48, 3000
    # From flat to peaked rows, so that some nuclei fit in the candidates and some do not.
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.2, 8.0, rows).unsqueeze(1)
    top_k = torch.tensor([[vocab, 5, 200, vocab, vocab, 40][i % 6] for i in range(rows)]).unsqueeze(1)
    top_p = torch.tensor([[0.5, 0.9, 0.99, 1.0, 0.7][i % 5] for i in range(rows)]).unsqueeze(1)
    monkeypatch.setattr(sampler_module, "_CPU_TOP_P_CANDIDATES", 64)
    _, covered = sampler_module._filter_candidates(logits, None, top_p, 64)
    assert covered.any() and not covered.all(), "both the fast path and the fallback must run"

    for k, p in [(top_k, None), (None, top_p), (top_k, top_p)]:
        out = apply_top_k_top_p(logits, k, p)
        for i in range(rows):
            ref = logits[i].double()
            if k is not None and k[i, 0] < vocab:
                ref = ref_top_k(ref, int(k[i, 0]))
            if p is not None and p[i, 0] < 1.0:
                ref = ref_top_p(ref, float(p[i, 0]))
            kept = torch.isfinite(out[i])
            assert torch.equal(kept, torch.isfinite(ref)), (i, kept.sum(), torch.isfinite(ref).sum())
            assert torch.equal(out[i][kept], logits[i][kept])


def test_sample_rows_kernel_inverts_the_cumulative_distribution_as_its_reference():
    """ops.sample_rows (kernel, with the extension) picks the token whose interval of the
    cumulative weights holds uniform * total, as the plain-torch reference does; min-p drops
    what it should; rows with nothing finite take their argmax."""
    from kvserve import ops
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 64, 5000  # several of the kernel's 1024-token blocks, and a partial one
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 6.0, rows).unsqueeze(1)
    logits[3, ::2] = float("-inf")
    inv_t = torch.linspace(0.5, 2.0, rows)
    log_min_p = torch.where(torch.arange(rows) % 3 == 0, torch.tensor(0.05).log(), torch.tensor(float("-inf")))
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    got = ops.sample_rows(logits, inv_t, log_min_p, uniforms)
    ref = ops.sample_rows_reference(logits, inv_t, log_min_p, uniforms)
    assert (got != ref).sum() <= 1  # (a target within rounding of an interval's end may differ)
    scaled = (logits - logits.amax(-1, keepdim=True)) * inv_t.unsqueeze(1)
    assert (scaled.gather(1, got.unsqueeze(1)).squeeze(1) >= log_min_p).all()
    assert torch.isfinite(logits.gather(1, got.unsqueeze(1))).all()
    nothing = torch.full((2, 40), float("-inf"))
    nothing[1, 7] = float("inf")
    ones = torch.ones(2)
    assert ops.sample_rows(nothing, ones, ones * float("-inf"), torch.rand(2, dtype=torch.float64)).tolist() == [0, 7]
    # Masked (-inf) tokens weigh nothing, min-p off included: a uniform of 0 takes the first finite one.
    masked = torch.full((1, 50), float("-inf"))
    masked[0, 20], masked[0, 30] = 1.0, 0.5
    assert ops.sample_rows(masked, ones[:1], ones[:1] * float("-inf"), torch.zeros(1, dtype=torch.float64)).item() == 20


def test_top_p_floor_kernel_keeps_the_nucleus_a_sort_keeps():
    """ops.top_p_floor (binned mass, one bin sorted) gives the floor a full sort gives: the
    scaled logit of the last token kept, rows flat to peaked, temperatures, masked tokens."""
    from kvserve import ops
    gen = torch.Generator().manual_seed(14)
    rows, vocab = 48, 6000
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.1, 8.0, rows).unsqueeze(1)
    logits[5, ::3] = float("-inf")
    logits[7] = 1.5  # every token alike: all kept
    inv_t = torch.linspace(0.6, 1.6, rows)
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.3, 0.0])[torch.arange(rows) % 5]  # (0: the top token alone)
    got = ops.top_p_floor(logits, inv_t, top_p)
    ref = ops.top_p_floor_reference(logits, inv_t, top_p)
    assert (got != ref).sum() <= 1, (got - ref).abs().max()
    assert got[7] == 0.0
    assert ops.top_p_floor(torch.full((1, 9), float("-inf")), inv_t[:1], top_p[:1]).item() == float("-inf")


def test_candidate_sampling_route_matches_reference_distributions(monkeypatch):
    """The CPU sampler's top-k/top-p rows are filtered and sampled on their candidates (and
    in full where the nucleus reaches past them): every sampled token lies in the reference's
    kept set, and the frequencies follow the reference distribution."""
    monkeypatch.setattr(sampler_module, "_CPU_TOP_P_CANDIDATES", 64)
    vocab, draws = 3000, 4000
    gen = torch.Generator().manual_seed(12)
    peaked = torch.randn(vocab, generator=gen) * 4.0  # nucleus inside the 64 candidates
    flat = torch.randn(vocab, generator=gen) * 0.3    # nucleus past them
    cases = [(peaked, dict(temperature=0.8, top_p=0.9)), (flat, dict(temperature=1.0, top_p=0.5)),
             (peaked, dict(temperature=1.2, top_k=20, min_p=0.05)), (peaked, dict(temperature=1.0)),
             (flat, dict(temperature=0.9, top_k=10, top_p=0.8))]
    torch.manual_seed(5)
    requests = [make_request(**params) for _ in range(draws) for _, params in cases]
    logits = torch.stack([base for _ in range(draws) for base, _ in cases])
    tokens = sample(logits, requests).sampled_token_ids.view(draws, len(cases))
    for c, (base, params) in enumerate(cases):
        ref = ref_distribution(base, **params)
        counts = torch.bincount(tokens[:, c], minlength=vocab).double()
        assert counts[ref == 0].sum() == 0, (params, "sampled a token the reference excludes")
        # Compared on the reference's likelier tokens (the rest pooled), where 4,000 draws
        # measure the frequencies.
        top = ref.topk(12).indices
        expected = torch.cat([ref[top], (1 - ref[top].sum()).clamp(min=0).unsqueeze(0)])
        observed = torch.cat([counts[top], (draws - counts[top].sum()).unsqueeze(0)]) / draws
        assert total_variation(observed, expected) < 0.05, (params, observed, expected)


def test_seeded_draw_is_the_same_on_the_candidate_and_the_whole_row_routes():
    """Whether a top-p row is sampled on its candidates or over its whole row depends on the
    rest of the batch (the candidates are as many as its largest top-k); a seeded request
    must draw the same token either way."""
    vocab = 3000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(13)) * 0.3  # nucleus ~1,500 tokens
    alone, beside_top_k = [], []
    for seed in range(60):
        target = make_request(temperature=1.0, top_p=0.6, generator=make_generator(seed, "cpu"))
        alone.append(sample(logits, [target]).sampled_token_ids.item())
        target = make_request(temperature=1.0, top_p=0.6, generator=make_generator(seed, "cpu"))
        neighbour = make_request(temperature=1.0, top_k=2500)
        beside_top_k.append(sample(logits.expand(2, vocab).contiguous(), [neighbour, target]).sampled_token_ids[1].item())
    assert alone == beside_top_k
    assert len(set(alone)) > 30  # (a real spread of draws, not one token)


def test_argmax_suffices_only_for_plain_greedy_rows():
    """The LM head may rank approximately (RescoredLMHead's screen) only when sampling reads
    nothing but each row's argmax: any processor that could move it, or a read of the other
    logits, rules that out for the whole step."""
    greedy = dict(temperature=0.0)
    assert argmax_suffices([make_request(**greedy), make_request(**greedy)])
    assert argmax_suffices([make_request(output=(1, 2), eos=(3,), min_tokens=2, **greedy)])
    for other in [dict(temperature=0.7), dict(logprobs=0, **greedy), dict(logit_bias={5: 1.0}, **greedy),
                  dict(repetition_penalty=1.2, **greedy), dict(frequency_penalty=0.5, **greedy),
                  dict(presence_penalty=0.5, **greedy)]:
        assert not argmax_suffices([make_request(**greedy), make_request(**other)]), other
    # min_tokens not yet reached blocks EOS: the next best matters.
    assert not argmax_suffices([make_request(eos=(3,), min_tokens=2, **greedy)])
