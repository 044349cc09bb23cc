"""Engine side of the executor seam: ``SchedulerOutput`` (live requests) -> ``StepInput``.

Torch-free. The builder remembers which requests the workers have heard of and how many of
their output tokens they hold, so each step carries only what changed.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from kvserve.batch import SchedulerOutput
from kvserve.executor.step import ChunkInput, LateBitmasks, NewRequestData, StepInput
from kvserve.request import Request

# Stands for a token the engine does not know yet (ChunkInput.feeds_last_sampled): never fed
# to the model, the worker replaces it. Out of every vocabulary, so a slip shows at once.
PLACEHOLDER_TOKEN = -1


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole history."""
    prompt = request.prompt_token_ids
    n_prompt = len(prompt)
    if end <= n_prompt:
        return prompt[start:end]
    if start >= n_prompt:
        return request.output_token_ids[start - n_prompt:end - n_prompt]
    return prompt[start:] + request.output_token_ids[:end - n_prompt]


class StepBuilder:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # Request id -> number of its output tokens the workers hold.
        self._known: dict[str, int] = {}
        self._finished: list[str] = []

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests are finished: tell the workers with the next step."""
        for rid in request_ids:
            if self._known.pop(rid, None) is not None:
                self._finished.append(rid)

    @property
    def num_known(self) -> int:
        return len(self._known)

    def build(self, sched: SchedulerOutput) -> StepInput:
        step = StepInput(finished_request_ids=self._finished, num_steps=sched.num_steps)
        self._finished = []
        constrained: list[tuple[str, Request]] = []
        for chunk in sched.chunks:
            req = chunk.request
            rid = req.request_id
            sent = self._known.get(rid)
            if sent is None:
                params = req.sampling_params
                seed = None if params.seed is None else params.seed + child_index(rid, params.n)
                step.new_requests.append(NewRequestData(
                    request_id=rid, prompt_token_ids=req.prompt_token_ids, sampling_params=params,
                    eos_token_ids=req.eos_token_ids, seed=seed,
                    wants_prompt_logprobs=req.prompt_logprobs is not None))
                sent = 0
            num_out = req.num_output_tokens
            # (Async scheduling) the worker appends the tokens it samples itself: those that
            # steps in flight will sample are not to be sent again.
            self._known[rid] = num_out + req.num_output_placeholders
            start = req.num_computed_tokens
            spec = chunk.spec_token_ids
            end = start + chunk.num_new_tokens - len(spec)
            num_placeholders = max(0, end - req.num_tokens)
            if num_placeholders > 1 or (num_placeholders and spec):
                raise ValueError(f"request {rid}: a chunk may end in one placeholder token, without drafts "
                                 f"({num_placeholders} placeholders, {len(spec)} drafts)")
            tokens = token_slice(req, start, end - num_placeholders)
            if num_placeholders:
                tokens = tokens + [PLACEHOLDER_TOKEN]
            if spec:
                tokens = tokens + list(spec)
            needs_sample = chunk.needs_sample
            step.chunks.append(ChunkInput(
                request_id=rid, token_ids=tokens, start_position=start, block_tables=chunk.block_tables,
                num_drafts=len(spec), needs_sample=needs_sample, is_prefill=chunk.is_prefill,
                new_output_token_ids=req.output_token_ids[sent:num_out] if num_out > sent else [],
                num_prompt_logprobs_done=(None if req.prompt_logprobs is None
                                          else len(req.prompt_logprobs)),
                draft_probs=chunk.draft_probs, feeds_last_sampled=num_placeholders == 1))
            if needs_sample and req.grammar is not None:
                if req.num_output_placeholders:
                    # Its grammar has not seen the token the step in flight samples yet.
                    step.late_grammar_request_ids.append(rid)
                else:
                    constrained.append((rid, req))
        if constrained:
            step.grammar_bitmasks = self._bitmasks(constrained)
        return step

    def late_bitmasks(self, requests: list[Request]) -> LateBitmasks:
        """The bitmasks of a step's ``late_grammar_request_ids`` (these requests, in order), now
        that their grammars have the previous step's tokens. A request that has finished
        meanwhile gets every token allowed: its token is discarded, and the sampler must still
        find one."""
        live = [(req.request_id, req) for req in requests if not req.is_finished]
        masks = self._bitmasks(live) if live else {}
        words = (self.vocab_size + 31) // 32
        for req in requests:
            if req.is_finished:
                masks[req.request_id] = np.full(words, -1, dtype=np.int32)
        return LateBitmasks(masks)

    def _bitmasks(self, constrained: list[tuple[str, Request]]) -> dict[str, np.ndarray]:
        words = (self.vocab_size + 31) // 32
        bitmask = np.empty((len(constrained), words), dtype=np.int32)
        masks = {}
        for j, (rid, req) in enumerate(constrained):
            req.grammar.fill_bitmask(bitmask, j)
            masks[rid] = bitmask[j]
        return masks


def child_index(request_id: str, n: int) -> int:
    """The sibling index of an ``n > 1`` child ("<id>#<i>"): its RNG is seeded seed + i."""
    if n == 1:
        return 0
    return int(request_id.rsplit("#", 1)[1])
