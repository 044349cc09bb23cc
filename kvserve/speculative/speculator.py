"""Which requests draft this step, and how much: the "never a slowdown" policy.

Verifying k drafts costs a pass over k + 1 tokens instead of 1. A lone decode is memory-
bound (the weights are read once either way), so that is nearly free and every accepted
draft is a step saved. A large batch is compute-bound: the extra tokens cost their full
price, and drafts that are rejected are a pure loss. So:

- no drafting while more than ``disable_by_batch_size`` requests are decoding;
- per request, after a verify step that accepted nothing, drafting pauses for 1, 2, 4...
  steps (text that does not repeat its context stops paying at once); any accepted draft
  resets the pause. A draft model's forwards cost something: for it, a step "accepted
  nothing" when it accepted fewer drafts than its draft forwards cost (``min_accepted``);
- requests whose next-token distribution depends on the tokens before it in ways the
  batched verification does not replay (penalties, ``min_tokens`` still blocking EOS) do
  not draft.

Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from kvserve.request import Request
from kvserve.config.speculative import SpeculativeConfig
from kvserve.speculative.ngram import NgramDrafter

if TYPE_CHECKING:
    from kvserve.batch import ScheduledChunk


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k draft tokens to follow ``token_ids`` (possibly none)."""


@dataclass
class SpecStats:
    num_spec_steps: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields on average: its accepted drafts plus the one sampled."""
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0


@dataclass
class _RequestState:
    backoff: int = 0
    skip: int = 0


def can_speculate(request: Request) -> bool:
    params = request.sampling_params
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        return False  # the penalty at draft j would depend on drafts 0..j-1
    if request.grammar is not None:
        return False  # so would a grammar's token mask (its state after drafts 0..j-1)
    return request.num_output_tokens >= params.min_tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter) -> None:
        self.config = config
        self.drafter = drafter
        self.stats = SpecStats()
        self._state: dict[str, _RequestState] = {}

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """This step's drafts: request id -> draft tokens, for the running requests that draft
        now (none for the others). The engine hands them to the scheduler, which trims them to
        its budget and length limits and puts what it keeps on the step's chunks; a request never
        carries drafts itself."""
        drafts: dict[str, list[int]] = {}
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        if len(self._state) > 2 * len(running) + 64:
            alive = {r.request_id for r in running}
            self._state = {rid: s for rid, s in self._state.items() if rid in alive}
            if hasattr(self.drafter, "retain"):
                self.drafter.retain(alive)
        if not decoding or len(decoding) > self.config.disable_by_batch_size:
            return drafts
        for request in decoding:
            state = self._state.setdefault(request.request_id, _RequestState())
            if state.skip > 0:
                state.skip -= 1
                continue
            if not can_speculate(request):
                continue
            proposal = self.drafter.propose(request.all_token_ids, self.config.num_speculative_tokens)
            if proposal:
                drafts[request.request_id] = proposal
        return drafts

    def fill(self, chunks: Sequence["ScheduledChunk"]) -> int:
        """After scheduling: a deferred drafter (a draft model, which needs the step's
        lookahead slots for its own KV) replaces the planned placeholders with its drafts.
        Nothing to do for the n-gram drafter, whose drafts were final before scheduling."""
        if not getattr(self.drafter, "deferred", False):
            return 0
        # A batch small enough to draft in: the draft also computes this step's prompt
        # chunks, so its prefill rides with the target's instead of delaying the first draft.
        prefill = ([c for c in chunks if c.is_prefill and can_speculate(c.request)]
                   if len(chunks) <= self.config.disable_by_batch_size else [])
        return self.drafter.fill(chunks, prefill)

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Feed back one verify step of one request."""
        if num_drafts <= 0:
            return
        self.stats.num_spec_steps += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        state = self._state.setdefault(request_id, _RequestState())
        if num_accepted < self.min_accepted(num_drafts):
            if self.config.max_backoff_steps:
                state.backoff = min(max(1, 2 * state.backoff), self.config.max_backoff_steps)
                state.skip = state.backoff
        else:
            state.backoff = 0

    def min_accepted(self, num_drafts: int) -> int:
        """Accepted drafts a verify step needs to have paid for itself. A step yields 1 +
        accepted tokens; drafting cost ``num_drafts`` draft forwards of ``relative_cost``
        target steps each (0 for n-gram lookup: then any accepted draft pays)."""
        cost = getattr(self.drafter, "relative_cost", 0.0) * num_drafts
        return int(cost) + 1


def build_speculator(config: SpeculativeConfig, drafter: Optional[Drafter] = None) -> Speculator:
    """The n-gram drafter is built here; a draft model is loaded by the engine (it needs the
    device, the dtypes and the pool's block count) and passed in as ``drafter``."""
    if drafter is not None:
        return Speculator(config, drafter)
    if config.method == "ngram":
        drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max,
                               config.num_speculative_tokens)
        return Speculator(config, drafter)
    raise ValueError(f"unknown speculative method {config.method!r}")
