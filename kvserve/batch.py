"""The scheduler -> runner contract: what to compute in one engine step. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.request import Request


@dataclass
class ScheduledChunk:
    """Compute ``num_new_tokens`` tokens of ``request`` starting at its ``num_computed_tokens``.

    A decode step is a chunk of one token; a prefill (or a chunk of one) is several. The
    chunk needs logits (and a sampled token) only when it reaches the end of the request's
    known tokens: ``needs_sample``.

    A speculating decode also carries ``spec_token_ids``: the chunk is the request's last
    token followed by these drafts (``num_new_tokens`` counts them), logits are wanted at
    every one of its positions, and the runner returns the accepted run of tokens.
    """

    request: Request
    num_new_tokens: int
    # The request's whole block table after this step's allocation, one per KV cache group
    # (kvserve.kv_cache.KVCacheGroup); a model without sliding-window groups has one.
    block_tables: list[list[int]]
    spec_token_ids: list[int] = field(default_factory=list)
    # A model drafter sampling at temperature > 0: its processed distribution at each draft
    # ([k, vocab] float32 numpy array) for rejection sampling. None: q = 1 on the proposed tokens (n-gram,
    # greedy), and verification compares the target's samples with the drafts.
    draft_probs: Any = None
    # The request's progress when the chunk was scheduled: its computed tokens and the tokens
    # it plans for (known ones and placeholders). Under async scheduling the request moves on
    # (the next step is scheduled) before this chunk's result is applied; the chunk keeps
    # describing the work it was. Without it, the same values as the live request's.
    first_position: int = field(init=False)
    num_planned_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.first_position = self.request.num_computed_tokens
        self.num_planned_tokens = self.request.num_tokens_with_placeholders

    @property
    def block_ids(self) -> list[int]:
        """Group 0's table: the full-attention one, which holds every position."""
        return self.block_tables[0]

    @property
    def start_position(self) -> int:
        return self.first_position

    @property
    def needs_sample(self) -> bool:
        return (self.first_position + self.num_new_tokens
                >= self.num_planned_tokens + len(self.spec_token_ids))

    @property
    def num_logits(self) -> int:
        """Rows of logits this chunk needs: one per verified position, one to sample."""
        return len(self.spec_token_ids) + 1 if self.needs_sample else 0

    @property
    def is_prefill(self) -> bool:
        return (self.num_new_tokens - len(self.spec_token_ids) > 1
                or self.first_position < self.request.num_prompt_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Decode steps the runner takes before the next scheduling round (EngineArgs.
    # num_scheduler_steps): every chunk is then one request's decode of a generated token,
    # with lookahead slots for the steps after the first, and each request gets this many new
    # tokens.
    num_steps: int = 1

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
