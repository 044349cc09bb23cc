"""The engine -> executor contract: a plain, picklable snapshot of one step, and its result.

Torch-free and made of ints, lists and numpy arrays only, so the same object drives a model
in this process or is pickled once and sent to every worker of a tensor- or pipeline-parallel
group. Nothing here refers to a live ``Request``: what a worker must remember about a request
across steps (its sampling parameters, its RNG, the tokens it has produced) is sent once, when
the request is first scheduled (``NewRequestData``), and then only as increments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvserve.request import Logprob, SamplingParams


@dataclass
class NewRequestData:
    """What a worker keeps about a request from its first scheduled step until it finishes."""

    request_id: str
    prompt_token_ids: list[int]
    # Only the fields the sampler reads matter; the grammar spec is dropped (masks are sent).
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    # The seed of this request's own RNG (SamplingParams.seed + child index); None: shared RNG.
    seed: Optional[int]
    wants_prompt_logprobs: bool = False


@dataclass
class ChunkInput:
    """One request's share of the step (see batch.ScheduledChunk)."""

    request_id: str
    # The tokens fed to the model: the chunk's known tokens followed by its drafts.
    token_ids: list[int]
    start_position: int
    # The request's whole block table after this step's allocation, one per KV cache group.
    block_tables: list[list[int]]
    num_drafts: int = 0
    needs_sample: bool = False
    is_prefill: bool = False
    # Output tokens appended since the worker last heard of this request (penalties, min_tokens).
    new_output_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs already computed (requests that asked for them), else None.
    num_prompt_logprobs_done: Optional[int] = None
    # A model drafter sampling at temperature > 0: its distributions q at each draft, a
    # [num_drafts, vocab] float32 array, for rejection sampling; None: compare samples with drafts.
    draft_probs: Optional[np.ndarray] = None
    # Async scheduling: the chunk's last token is a placeholder for the token the previous
    # step sampled for this request, which the engine did not know when it built this step:
    # the worker feeds its own newest sampled token there.
    feeds_last_sampled: bool = False


@dataclass
class StepInput:
    chunks: list[ChunkInput] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests the worker may forget (finished or aborted since the previous step).
    finished_request_ids: list[str] = field(default_factory=list)
    # Structured outputs: request id -> this step's allowed-token bitmask (int32 words, one bit
    # per token, the grammar's own layout), computed engine-side where the grammar lives.
    grammar_bitmasks: dict[str, np.ndarray] = field(default_factory=dict)
    # Decode steps to take (SchedulerOutput.num_steps): each later one feeds every request the
    # token the step before sampled, into the lookahead slots its block tables already hold.
    num_steps: int = 1
    # Async scheduling: constrained requests whose bitmask the engine could not build yet (their
    # grammar waits for the token the previous step samples). The bitmasks follow in a
    # message of their own (LateBitmasks) that the worker reads after the forward pass,
    # before sampling.
    late_grammar_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class StepOutput:
    # Per sampled request, its new tokens: one, or a speculating request's accepted drafts
    # followed by the target's next token. Logprobs likewise, one entry per new token.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # Request id -> logprobs of the prompt tokens this step's chunk predicted, in order.
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


@dataclass
class LateBitmasks:
    """The bitmasks a step's ``late_grammar_request_ids`` wait for (request id -> int32 words),
    sent once the engine has advanced their grammars with the previous step's tokens."""

    bitmasks: dict[str, np.ndarray] = field(default_factory=dict)
