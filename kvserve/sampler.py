"""Batched sampling on the device: one call turns a step's logits into one token per row.

Processing order (vLLM's, which follows HF's): logit_bias, min_tokens blocking, penalties
(repetition, frequency, presence); greedy rows then take the argmax; random rows go through
temperature, top-k, top-p, min-p and one draw per row: on the CPU the inverse of the row's
cumulative distribution at one uniform (kvserve.ops.sample_rows), on other devices an
exponential race (argmax of p / q, q ~ Exp(1): a uniform per token, but no host sync).
Logprobs come from the raw logits.

``SamplingMetadata`` is rebuilt every step from the batch's requests. It only carries tensors
for features some row actually uses, so a batch of plain greedy requests costs one argmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

import numpy as np
import torch

from kvserve import ops
from kvserve.request import Logprob, Request, SamplingParams

# Temperatures below this are treated as greedy: dividing by them would overflow the logits
# and the resulting distribution is an argmax anyway.
_GREEDY_TEMPERATURE = 1e-5


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request RNG on ``device``; a request sampled with it is reproducible whatever
    else shares its batch."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingMetadata:
    """Per-row sampling state for one step (row i is the i-th request handed to the builder).

    A field is None when no row uses the feature; the flags say the same for cheap branching.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    # [S] bool, True for greedy rows; only when the batch mixes greedy and random rows.
    greedy_mask: Optional[torch.Tensor]
    # [S, 1] float; greedy rows hold 1.0 so the division is harmless. None when all greedy.
    temperature: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor]  # [S, 1] int64, disabled rows hold the vocab size
    top_p: Optional[torch.Tensor]  # [S, 1] float, disabled rows hold 1.0
    min_p: Optional[torch.Tensor]  # [S, 1] float, disabled rows hold 0.0
    # Sparse (row indices, token ids, values) triples, applied with one index_put.
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # (row indices, token ids) forced to -inf: EOS and stop tokens before min_tokens is reached.
    min_tokens_blocked: Optional[tuple[torch.Tensor, torch.Tensor]]
    # Penalties: per-row parameters [S, 1] with neutral values for rows that use none.
    repetition_penalty: Optional[torch.Tensor]
    frequency_penalty: Optional[torch.Tensor]
    presence_penalty: Optional[torch.Tensor]
    prompt_mask: Optional[torch.Tensor]  # [S, V] bool: token occurs in the prompt
    output_counts: Optional[torch.Tensor]  # [S, V] float: occurrences in the output so far
    # Rows with their own RNG: row index -> torch.Generator. Other random rows share one draw.
    generators: dict[int, torch.Generator]
    # Per-row number of logprob alternatives (None: row did not ask); None if no row asked.
    num_logprobs: Optional[list[Optional[int]]]
    # Structured outputs: (row indices, [R, ceil(V / 32)] int32 bitmask on the host, bit t
    # allowing token t) of the rows whose output follows a grammar; None when no row does.
    allowed_tokens: Optional[tuple[list[int], np.ndarray]] = None

    @property
    def no_penalties(self) -> bool:
        return self.output_counts is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def max_num_logprobs(self) -> Optional[int]:
        if self.num_logprobs is None:
            return None
        return max(n for n in self.num_logprobs if n is not None)


class SamplingRow(Protocol):
    """What the sampler reads of a request: the runner's RequestState (what the runner keeps of
    a request between steps), or anything shaped like it. Its RNG is the row's own (seeded once,
    so the stream continues across steps and preemptions)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    generator: Optional[torch.Generator]
    grammar: Any  # an object with fill_bitmask(bitmask, row), or None

    @property
    def num_output_tokens(self) -> int: ...


def argmax_suffices(requests: Sequence[SamplingRow]) -> bool:
    """Whether sampling these rows reads nothing of the logits but each row's argmax: every
    row greedy, with no logprobs, no grammar, and no logit bias, min_tokens blocking or
    penalty that could move the argmax (build_sampling_metadata's conditions). The LM head
    may then rank the vocabulary approximately and compute exact logits only for its best
    candidates (kvserve.quant.RescoredLMHead)."""
    for r in requests:
        p = r.sampling_params
        if (p.temperature >= _GREEDY_TEMPERATURE or p.logprobs is not None or p.logit_bias
                or r.grammar is not None or r.num_output_tokens < p.min_tokens
                or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            return False
    return True


def needs_no_step_state(request: Union[Request, SamplingRow]) -> bool:
    """Whether sampling this request's next token reads nothing that its last token changed:
    no penalties (they count the output), no min_tokens still blocking EOS, no grammar (advanced
    by the engine after each token) and no logprobs (gathered per step). Its SamplingMetadata
    then serves several steps in a row (multi-step decoding); greedy or sampled alike, a
    seeded request's generator advancing one draw per step as it would step by step."""
    p = request.sampling_params
    return (p.logprobs is None and request.grammar is None and request.num_output_tokens >= p.min_tokens
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)


def build_sampling_metadata(requests: Sequence[SamplingRow], vocab_size: int,
                            device: torch.device | str) -> SamplingMetadata:
    """Gather the batch's sampling parameters into device tensors (runs once per step)."""
    num_rows = len(requests)
    params = [r.sampling_params for r in requests]
    greedy = [p.temperature < _GREEDY_TEMPERATURE for p in params]
    all_greedy = all(greedy)
    all_random = not any(greedy)

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

    greedy_mask = temperature = top_k = top_p = min_p = None
    generators: dict[int, torch.Generator] = {}
    if not all_greedy:
        if not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        temperature = column([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                             torch.float32)
        # Greedy rows ignore the filters; neutral values keep the batched ops uniform.
        if any(not g and 0 < p.top_k < vocab_size for g, p in zip(greedy, params)):
            top_k = column([p.top_k if not g and 0 < p.top_k < vocab_size else vocab_size
                            for g, p in zip(greedy, params)], torch.int64)
        if any(not g and p.top_p < 1.0 for g, p in zip(greedy, params)):
            top_p = column([1.0 if g else p.top_p for g, p in zip(greedy, params)], torch.float32)
        if any(not g and p.min_p > 0.0 for g, p in zip(greedy, params)):
            min_p = column([0.0 if g else p.min_p for g, p in zip(greedy, params)], torch.float32)
        for i, (g, req) in enumerate(zip(greedy, requests)):
            if g:
                continue
            if req.generator is not None:
                generators[i] = req.generator

    logit_bias = None
    if any(p.logit_bias for p in params):
        rows, toks, vals = [], [], []
        for i, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                rows.append(i)
                toks.append(int(tok))
                vals.append(float(bias))
        logit_bias = (torch.tensor(rows, dtype=torch.int64, device=device),
                      torch.tensor(toks, dtype=torch.int64, device=device),
                      torch.tensor(vals, dtype=torch.float32, device=device))

    min_tokens_blocked = None
    if any(r.num_output_tokens < p.min_tokens for r, p in zip(requests, params)):
        rows, toks = [], []
        for i, (r, p) in enumerate(zip(requests, params)):
            if r.num_output_tokens >= p.min_tokens:
                continue
            # With ignore_eos the EOS token does not end the request, so it needs no blocking.
            blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            blocked = {t for t in blocked if 0 <= t < vocab_size}
            rows.extend([i] * len(blocked))
            toks.extend(sorted(blocked))
        if rows:
            min_tokens_blocked = (torch.tensor(rows, dtype=torch.int64, device=device),
                                  torch.tensor(toks, dtype=torch.int64, device=device))

    repetition = frequency = presence = prompt_mask = output_counts = None
    uses_rep = [p.repetition_penalty != 1.0 for p in params]
    uses_freq_pres = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if any(uses_rep) or any(uses_freq_pres):
        repetition = column([p.repetition_penalty for p in params], torch.float32)
        frequency = column([p.frequency_penalty for p in params], torch.float32)
        presence = column([p.presence_penalty for p in params], torch.float32)
        output_counts = _token_counts(
            [r.output_token_ids if (rep or fp) else [] for r, rep, fp
             in zip(requests, uses_rep, uses_freq_pres)], vocab_size, device)
        if any(uses_rep):
            prompt_mask = _token_mask(
                [r.prompt_token_ids if rep else [] for r, rep in zip(requests, uses_rep)],
                vocab_size, device)

    num_logprobs = None
    if any(p.logprobs is not None for p in params):
        num_logprobs = [p.logprobs for p in params]

    allowed_tokens = None
    if any(r.grammar is not None for r in requests):
        allowed_tokens = grammar_masks(requests, vocab_size)

    return SamplingMetadata(
        num_rows=num_rows, all_greedy=all_greedy, all_random=all_random,
        greedy_mask=greedy_mask, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, logit_bias=logit_bias, min_tokens_blocked=min_tokens_blocked,
        repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence,
        prompt_mask=prompt_mask, output_counts=output_counts, generators=generators,
        num_logprobs=num_logprobs, allowed_tokens=allowed_tokens)


def grammar_masks(requests: Sequence[SamplingRow], vocab_size: int) -> tuple[list[int], np.ndarray]:
    """Each constrained row's allowed next tokens: its grammar writes one row of a packed
    bitmask (one bit per token, llguidance's layout), applied to the logits as it is."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    bitmask = np.empty((len(rows), (vocab_size + 31) // 32), dtype=np.int32)
    for j, i in enumerate(rows):
        requests[i].grammar.fill_bitmask(bitmask, j)
    return rows, bitmask


def _padded_ids(token_lists: list[list[int]], vocab_size: int,
                device: torch.device | str) -> Optional[torch.Tensor]:
    """Ragged lists as one [S, W] tensor; padding points at an extra column (vocab_size)
    that is dropped after scattering."""
    width = max((len(t) for t in token_lists), default=0)
    if not width:
        return None
    return torch.tensor([toks + [vocab_size] * (width - len(toks)) for toks in token_lists],
                        dtype=torch.int64).to(device)


def _token_counts(token_lists: list[list[int]], vocab_size: int,
                  device: torch.device | str) -> torch.Tensor:
    """[S, V] float: how often each token occurs in each row's list (one scatter_add)."""
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    padded = _padded_ids(token_lists, vocab_size, device)
    if padded is not None:
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _token_mask(token_lists: list[list[int]], vocab_size: int,
                device: torch.device | str) -> torch.Tensor:
    """[S, V] bool: whether each token occurs in each row's list."""
    mask = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.bool, device=device)
    padded = _padded_ids(token_lists, vocab_size, device)
    if padded is not None:
        mask.scatter_(1, padded, True)
    return mask[:, :vocab_size]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64, on the logits' device
    # Per row: {token_id: Logprob} with the sampled token and the top-N alternatives;
    # None for rows that did not ask. The whole list is None when no row asked.
    logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None


class Sampler:
    """Stateless: all per-request state lives in the metadata (and the requests' generators)."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (logits.shape, md.num_rows)
        logits = logits.float()
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if md.num_logprobs is not None else None)

        logits = self.apply_logits_processors(logits, md)
        if md.all_greedy:
            sampled = ops.argmax(logits)
        else:
            sampled = self.sample_random(logits, md)
            if md.greedy_mask is not None:
                sampled = torch.where(md.greedy_mask, ops.argmax(logits), sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = self.gather_logprobs(raw_logprobs, sampled, md)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Grammar masks, logit_bias, min_tokens blocking, then penalties. Never modifies the
        input tensor."""
        if md.allowed_tokens is not None:
            logits = apply_allowed_tokens(logits, *md.allowed_tokens)
        if md.logit_bias is not None:
            rows, toks, vals = md.logit_bias
            logits = logits.index_put((rows, toks), vals, accumulate=True)
        if md.min_tokens_blocked is not None:
            rows, toks = md.min_tokens_blocked
            logits = logits.index_put((rows, toks), logits.new_full(rows.shape, float("-inf")))
        if md.output_counts is not None:
            logits = apply_penalties(logits, md)
        return logits

    @staticmethod
    def sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row: on the CPU by inverting
        each row's cumulative distribution at one uniform (ops.sample_rows), elsewhere by an
        exponential race (a uniform per token, but no host sync)."""
        if logits.device.type != "cpu":
            return exponential_race(Sampler.processed_probs(logits, md), md.generators)
        assert md.temperature is not None
        temperature = md.temperature.squeeze(1)
        # min-p keeps p >= min_p * p_max, i.e. a scaled logit at least log(min_p) under the top one.
        log_min_p = (md.min_p.squeeze(1).log() if md.min_p is not None
                     else torch.full_like(temperature, float("-inf")))
        uniforms = row_uniforms(md.num_rows, md.generators)
        if md.top_k is None and md.top_p is None:
            return ops.sample_rows(logits, 1.0 / temperature, log_min_p, uniforms)
        vocab = logits.shape[-1]
        top_k = md.top_k.squeeze(1) if md.top_k is not None else torch.full_like(temperature, vocab, dtype=torch.int64)
        top_p = md.top_p.squeeze(1) if md.top_p is not None else torch.ones_like(temperature)
        filtered = (top_k < vocab) | (top_p < 1.0)
        tokens = torch.empty(md.num_rows, dtype=torch.int64)
        # Rows with neither filter over their whole vocabulary, the others on their candidates.
        for uses_filter in (False, True):
            rows = (filtered == uses_filter).nonzero().squeeze(1)
            if not rows.numel():
                continue
            x = logits if rows.numel() == md.num_rows else logits[rows]
            if uses_filter:
                tokens[rows] = _sample_top_k_top_p_rows(x, temperature[rows], top_k[rows], top_p[rows],
                                                        log_min_p[rows], uniforms[rows], md.top_p is not None)
            else:
                tokens[rows] = ops.sample_rows(x, 1.0 / temperature[rows], log_min_p[rows], uniforms[rows])
        return tokens

    @staticmethod
    def processed_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows sample from: ``logits`` (after the logits processors)
        through temperature, top-k, top-p and min-p (unnormalised after min-p). Speculative
        rejection sampling compares the draft's and the target's with the same processing."""
        assert md.temperature is not None
        logits = logits / md.temperature
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        if md.min_p is not None:
            # Relative to the top token, which top-k/top-p never remove: the kept set is the
            # same whether min-p is applied before or after them.
            threshold = md.min_p * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    @staticmethod
    def target_logprobs(logprobs: torch.Tensor, targets: torch.Tensor,
                        num_top: int) -> list[dict[int, Logprob]]:
        """Per row: the target token's logprob and rank, then the top ``num_top`` (prompt
        logprobs: the target is the prompt's next token, not a sampled one)."""
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        top_lp: list[list[float]] = []
        top_ids: list[list[int]] = []
        if num_top > 0:
            values, indices = ops.top_k(logprobs, num_top)
            top_lp, top_ids = values.tolist(), indices.tolist()
        result = []
        for i, (tok, lp) in enumerate(zip(targets.tolist(), chosen.squeeze(1).tolist())):
            entry = {tok: Logprob(tok, lp, ranks[i])}
            for j in range(num_top):
                entry.setdefault(top_ids[i][j], Logprob(top_ids[i][j], top_lp[i][j], j + 1))
            result.append(entry)
        return result

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor,
                        md: SamplingMetadata) -> list[Optional[dict[int, Logprob]]]:
        """The sampled token's logprob and rank plus the top-N alternatives, per asking row."""
        assert md.num_logprobs is not None
        max_n = md.max_num_logprobs or 0
        top_lp: list[list[float]] = []
        top_ids: list[list[int]] = []
        chosen = logprobs.gather(1, sampled.unsqueeze(1))  # [S, 1]
        # Rank 1 is the most likely token; ties share the better rank.
        chosen_rank = (logprobs > chosen).sum(dim=-1) + 1
        if max_n > 0:
            values, indices = ops.top_k(logprobs, max_n)
            top_lp, top_ids = values.tolist(), indices.tolist()
        sampled_ids = sampled.tolist()
        sampled_lp = chosen.squeeze(1).tolist()
        ranks = chosen_rank.tolist()

        result: list[Optional[dict[int, Logprob]]] = []
        for i, n in enumerate(md.num_logprobs):
            if n is None:
                result.append(None)
                continue
            entry = {sampled_ids[i]: Logprob(sampled_ids[i], sampled_lp[i], ranks[i])}
            for j in range(n):
                tok = top_ids[i][j]
                if tok not in entry:
                    entry[tok] = Logprob(tok, top_lp[i][j], j + 1)
            result.append(entry)
        return result


def apply_allowed_tokens(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    """-inf outside each constrained row's allowed tokens (a new tensor)."""
    return ops.apply_token_bitmask(logits, rows, bitmask)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM: seen tokens' logits divided if positive, multiplied if negative;
    seen = prompt or output), then OpenAI's frequency and presence penalties on output tokens."""
    assert md.output_counts is not None
    counts = md.output_counts
    if md.prompt_mask is not None:
        seen = md.prompt_mask | (counts > 0)
        penalty = md.repetition_penalty
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty * counts
    logits = logits - md.presence_penalty * (counts > 0).float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask tokens outside the top-k, then outside the top-p nucleus of what is left.

    Top-k keeps exactly k tokens; top-p keeps the smallest prefix (by probability) whose
    mass, renormalised after top-k, reaches p, and always the top token. Rows that use
    neither are returned unchanged.

    On the GPU this is one sort of the batch. On the CPU a full sort is the most expensive
    thing in sampling (hundreds of ms for 64 rows of 49k tokens) while the kept set is
    usually a few hundred tokens, so the work is done on the top candidates (one topk) and
    only rows whose nucleus reaches past them are sorted in full. Both paths are exact.
    """
    vocab = logits.shape[-1]
    num_candidates = vocab
    if logits.device.type == "cpu":
        num_candidates = _cpu_num_candidates(top_k, top_p is not None, vocab)
    filtered, covered = _filter_candidates(logits, top_k, top_p, num_candidates)
    if covered is not None and not bool(covered.all()):
        rows = (~covered).nonzero().squeeze(1)
        full, _ = _filter_candidates(logits[rows], None if top_k is None else top_k[rows],
                                     top_p[rows], vocab)
        filtered[rows] = full
    active = torch.zeros(logits.shape[0], 1, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        active |= top_k < vocab
    if top_p is not None:
        active |= top_p < 1.0
    return torch.where(active, filtered, logits)


# Candidates examined for top-p on the CPU before falling back to a full sort of a row.
_CPU_TOP_P_CANDIDATES = 1024


def _cpu_num_candidates(top_k: Optional[torch.Tensor], uses_top_p: bool, vocab: int) -> int:
    """How many of each row's best tokens the CPU's top-k/top-p filtering looks at: the
    largest top-k, and at least _CPU_TOP_P_CANDIDATES where some row has top-p without a
    top-k (with a top-k on every row nothing outside the largest one can be kept)."""
    # .item() is a host sync, free on the CPU.
    max_k = int(torch.where(top_k < vocab, top_k, 0).max().item()) if top_k is not None else 0
    every_row_top_k = top_k is not None and bool((top_k < vocab).all())
    return min(vocab, max_k if not uses_top_p or every_row_top_k else max(max_k, _CPU_TOP_P_CANDIDATES))


def _filter_candidates(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor], num_candidates: int
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Top-k/top-p over the ``num_candidates`` best tokens of each row (all of them: a sort).

    Returns the filtered logits (-inf outside the kept set) and, when candidates are fewer
    than the vocabulary and top-p is used, which rows had their nucleus inside the
    candidates (the others' results are not valid). Every row's top-k must be at most
    ``num_candidates`` or disabled (= vocabulary size).
    """
    vocab = logits.shape[-1]
    if num_candidates < vocab:
        cand_logits, cand_idx = ops.top_k(logits, num_candidates)  # sorted, descending
    else:
        cand_logits, cand_idx = logits.sort(dim=-1, descending=True)
    row_log_norm = (logits.logsumexp(dim=-1, keepdim=True)
                    if top_p is not None and num_candidates < vocab else None)
    kept, covered = _kept_candidates(cand_logits, top_k, top_p, row_log_norm, vocab)
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, cand_idx, kept)
    return filtered, covered


def _kept_candidates(cand_logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                     row_log_norm: Optional[torch.Tensor], vocab: int
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The candidates (a row's best logits, sorted descending) with -inf where top-k or top-p
    removes them, and, with top-p over fewer candidates than the vocabulary, which rows had
    their nucleus inside them. ``row_log_norm`` [S, 1]: each whole row's logsumexp, given
    exactly when the candidates are fewer than the vocabulary and top-p is used."""
    positions = torch.arange(cand_logits.shape[-1], device=cand_logits.device).unsqueeze(0)
    remove = torch.zeros_like(cand_logits, dtype=torch.bool)
    if top_k is not None:
        remove |= positions >= top_k
        cand_logits = cand_logits.masked_fill(remove, float("-inf"))
    covered = None
    if top_p is not None:
        # Normalise over everything top-k left: the candidates when top-k cut inside them,
        # else the whole row.
        log_norm = cand_logits.logsumexp(dim=-1, keepdim=True)
        if row_log_norm is not None:
            cut_inside = top_k < vocab if top_k is not None else torch.zeros_like(log_norm, dtype=torch.bool)
            log_norm = torch.where(cut_inside, log_norm, row_log_norm)
        probs = torch.exp(cand_logits - log_norm)
        cumulative = probs.cumsum(dim=-1)
        # Rows with top_p == 1 keep everything (rounding could otherwise cut a tiny tail).
        remove |= ((cumulative - probs) >= top_p) & (top_p < 1.0)
        if row_log_norm is not None:
            covered = ((cumulative[:, -1:] >= top_p) | (top_p >= 1.0)).squeeze(1)
    return cand_logits.masked_fill(remove, float("-inf")), covered


def _sample_top_k_top_p_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, log_min_p: torch.Tensor, uniforms: torch.Tensor,
                             uses_top_p: bool) -> torch.Tensor:
    """The CPU sampler's rows with a top-k or top-p (per-row [R] parameters; disabled ones
    hold the vocabulary size and 1.0): the kept set as apply_top_k_top_p keeps it, but built
    and sampled on the candidates ([R, C] tensors, C = top-k or _CPU_TOP_P_CANDIDATES), and
    the whole row only where the nucleus reaches past them. The vocabulary-wide [R, V]
    temporaries of that route (the scaled logits, the filtered copy and the select) were
    most of a 32-row Gemma 3 step's sampling."""
    vocab = logits.shape[-1]
    num_candidates = _cpu_num_candidates(top_k, uses_top_p, vocab)
    ones = torch.ones_like(temperature)
    top_k_col, top_p_col = top_k.unsqueeze(1), (top_p.unsqueeze(1) if uses_top_p else None)
    if num_candidates < vocab:
        # Dividing by a row's temperature keeps its order: the candidates of the raw logits.
        cand_logits, cand_idx = ops.top_k(logits, num_candidates)
        row_log_norm = (ops.row_logsumexp(logits, 1.0 / temperature).unsqueeze(1)
                        if uses_top_p else None)
        kept, covered = _kept_candidates(cand_logits / temperature.unsqueeze(1), top_k_col, top_p_col,
                                         row_log_norm, vocab)
        # In vocabulary order, as the whole-row route walks: a row's draw is then the same
        # token whichever route the rest of its batch sends it (a seeded request's included).
        order = cand_idx.argsort(dim=1)
        kept, cand_idx = kept.gather(1, order), cand_idx.gather(1, order)
        picked = ops.sample_rows(kept, ones, log_min_p, uniforms)
        tokens = cand_idx.gather(1, picked.unsqueeze(1)).squeeze(1)
        if covered is None or bool(covered.all()):
            return tokens
        rows = (~covered).nonzero().squeeze(1)
    else:
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        rows = torch.arange(logits.shape[0])
    # Nucleus past the candidates (or candidates as many as the vocabulary): whole rows. Where
    # a row's top-k cuts (it keeps at most the candidates, so only with candidates as many as
    # the vocabulary), the filter of apply_top_k_top_p; top-p alone, its floor without a sort.
    x = logits[rows]
    if bool((top_k[rows] < vocab).any()) or not uses_top_p:
        filtered = apply_top_k_top_p(x / temperature[rows].unsqueeze(1), top_k_col[rows],
                                     top_p_col[rows] if uses_top_p else None)
        tokens[rows] = ops.sample_rows(filtered, ones[rows], log_min_p[rows], uniforms[rows])
        return tokens
    inv_temperature = 1.0 / temperature[rows]
    floor = torch.maximum(log_min_p[rows], ops.top_p_floor(x, inv_temperature, top_p[rows]))
    tokens[rows] = ops.sample_rows(x, inv_temperature, floor, uniforms[rows])
    return tokens


def row_uniforms(num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: seeded rows from their own generator (so a
    seeded request draws the same whatever shares its batch), the others from the default one."""
    uniforms = torch.empty(num_rows, dtype=torch.float64)
    if len(generators) < num_rows:
        uniforms.uniform_()
    for row, generator in generators.items():
        uniforms[row:row + 1].uniform_(generator=generator)
    return uniforms


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row: argmax(p / q) with q ~ Exp(1) picks token i with probability
    p_i. Seeded rows draw from their own generator (one draw per step, that row only); the
    others share one batched draw from the device's default generator."""
    num_rows = probs.shape[0]
    uniform = torch.empty_like(probs)
    if len(generators) < num_rows:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    # q = -log(u) is Exp(1) and much cheaper on the CPU than exponential_(). u == 0 gives
    # q == inf, i.e. p / q == 0: that token simply loses; q is never 0, so no NaN.
    q = uniform.log_().neg_()
    return (probs / q).argmax(dim=-1)
