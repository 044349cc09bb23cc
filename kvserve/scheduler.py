"""The compute scheduler: decides which tokens of which requests run in the next step.

Torch-free. One rule covers prefill, chunked prefill, prefix-cache hits and decode: each
request's ``num_computed_tokens`` catches up with its ``num_tokens``, within a per-step
token budget. Running requests go first, in order; waiting ones are admitted after, in
arrival order. ``allocate_slots`` returning None is the single trigger for preemption
(by recompute: the newest running request gives all its blocks back and starts over,
mostly from the prefix cache).

Pipeline parallelism keeps several steps in flight, one per micro-batch: with
``num_micro_batches`` > 1 each request belongs to one micro-batch (the least loaded when it
arrives) and ``schedule(micro_batch)`` picks work among that micro-batch's requests only, so
a request is never in two steps at once. The micro-batches share the token rules, the KV pool
and ``max_num_seqs``; one preempts only its own requests (the others may be in flight).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from kvserve.batch import ScheduledChunk, SchedulerOutput
from kvserve.kv_manager import KVCacheManager
from kvserve.request import Request, RequestRejected, RequestStatus
from kvserve.stopping import check_token_stop, max_new_tokens


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_micro_batches: int = 1,
        num_scheduler_steps: int = 1,
        multi_step_eligible: Optional[Callable[[Request], bool]] = None,
        before_free: Optional[Callable[[Request], None]] = None,
    ) -> None:
        if (max_num_batched_tokens < 1 or max_num_seqs < 1 or max_model_len < 2 or num_micro_batches < 1
                or num_scheduler_steps < 1):
            raise ValueError("max_num_batched_tokens, max_num_seqs, num_micro_batches and num_scheduler_steps "
                             "must be >= 1, max_model_len >= 2")
        self.kv_manager = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_micro_batches = num_micro_batches
        self._micro_batch_load = [0] * num_micro_batches  # unfinished requests in each
        # Multi-step decoding: up to this many decode steps per scheduling round, for rounds
        # where ``multi_step_eligible`` accepts every running request (see _num_steps).
        self.num_scheduler_steps = num_scheduler_steps
        self.multi_step_eligible = multi_step_eligible
        # Called with each request that finishes, its status set and its blocks still held
        # (a prefill instance publishes their KV there, before they go back to the pool).
        self.before_free = before_free

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Optional[Request]:
        return self._requests.get(request_id)

    # ---- admission -----------------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Raise RequestRejected if ``request`` could never run to completion."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            if num_prompt >= self.max_model_len:
                raise RequestRejected(
                    f"the prompt has {num_prompt} tokens, which leaves no room to generate within "
                    f"the maximum context length of {self.max_model_len} tokens")
            total = self.max_model_len
        else:
            total = num_prompt + max_tokens
            if total > self.max_model_len:
                raise RequestRejected(
                    f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is {total} tokens, "
                    f"more than the maximum context length of {self.max_model_len} tokens")
        # The last sampled token is never fed back, so it needs no KV slot. With sliding-window
        # groups the cost is each group's peak, a prefill chunk's window included.
        kv = self.kv_manager
        blocks_needed = kv.max_blocks_for(total - 1, self.max_num_batched_tokens)
        if blocks_needed > kv.num_usable_blocks:
            groups = f" over {kv.num_groups} KV cache groups" if kv.num_groups > 1 else ""
            raise RequestRejected(
                f"the request needs up to {total - 1} tokens of KV cache ({blocks_needed} blocks of "
                f"{kv.block_size}{groups}), more than the whole cache holds ({kv.num_usable_blocks} blocks, "
                f"{kv.num_usable_blocks * kv.block_size} tokens); lower max_tokens or the prompt length")
        if not self.enable_chunked_prefill and num_prompt > self.max_num_batched_tokens:
            raise RequestRejected(
                f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with chunked prefill disabled")

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        load = self._micro_batch_load
        request.micro_batch = load.index(min(load))
        load[request.micro_batch] += 1
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose KV for all but its newest token is already in the blocks the
        KV manager holds for it (received from a prefill instance): it runs from its next
        token on, as if it had been computed here."""
        if request.request_id in self._requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if request.num_tokens - request.num_computed_tokens != 1:
            raise ValueError(f"request {request.request_id}: {request.num_computed_tokens} of "
                             f"{request.num_tokens} tokens computed; a received request lacks exactly one")
        request.status = RequestStatus.RUNNING
        load = self._micro_batch_load
        request.micro_batch = load.index(min(load))
        load[request.micro_batch] += 1
        self._requests[request.request_id] = request
        self.running.append(request)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self, micro_batch: int = 0, drafts: Optional[Mapping[str, Sequence[int]]] = None) -> SchedulerOutput:
        """Pick this step's work (among ``micro_batch``'s requests). ``drafts`` (speculative
        decoding: request id -> draft tokens proposed for this step) are verified on the
        requests' decode chunks, as many as fit. Does not advance ``num_computed_tokens`` past
        the cache hits."""
        drafts = drafts or {}
        out = SchedulerOutput(num_steps=self._num_steps(micro_batch, drafts))
        budget = self._schedule_running(out, self.max_num_batched_tokens, micro_batch, drafts)
        # After a preemption the victims head the waiting queue and cannot fit yet, and
        # admission is first come first served: nobody jumps in to thrash the cache.
        self._schedule_waiting(out, budget, micro_batch)
        return out

    def running_in(self, micro_batch: int) -> list[Request]:
        """The running requests of ``micro_batch``, in order (all of them with one)."""
        if self.num_micro_batches == 1:
            return self.running
        return [r for r in self.running if r.micro_batch == micro_batch]

    def _num_steps(self, micro_batch: int, drafts: Mapping[str, Sequence[int]]) -> int:
        """How many decode steps this round runs (multi-step decoding, vLLM's
        ``--num-scheduler-steps``). More than one only when nothing waits for admission (a
        waiting request's first token would wait for the whole round) and every running request
        decodes one generated token (not a prompt's last), with no drafts, that
        ``multi_step_eligible`` accepts (the engine's rule, sampler.needs_no_step_state: no
        logprobs, grammar, penalties or min_tokens still to reach); never past any request's
        length limits, so each takes every step's token up to a stop. A stop found in the middle
        (EOS, a stop string) ends the request there, as a stop in a speculative run does."""
        running = self.running
        if (self.num_scheduler_steps == 1 or self.waiting or not running or self.num_micro_batches > 1
                or self.multi_step_eligible is None or drafts):
            return 1
        if any(r.num_tokens - r.num_computed_tokens != 1 or r.num_computed_tokens < r.num_prompt_tokens
               or not self.multi_step_eligible(r) for r in running):
            return 1
        return max(1, min(self.num_scheduler_steps, *(max_new_tokens(r, self.max_model_len) for r in running)))

    def _schedule_running(self, out: SchedulerOutput, budget: int, micro_batch: int,
                          drafts: Mapping[str, Sequence[int]]) -> int:
        mine = self.running_in(micro_batch)
        i = 0
        while i < len(mine) and budget > 0:
            request = mine[i]
            if request.num_output_placeholders and max_new_tokens(request, self.max_model_len) <= \
                    request.num_output_placeholders:
                # (Async scheduling) the step in flight samples its last allowed token: it ends
                # there, by length, whatever the token. Nothing to plan for it.
                i += 1
                continue
            num_new = min(request.num_tokens_with_placeholders - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            spec = self._spec_tokens(request, drafts.get(request.request_id), num_new, budget)
            # Drafts, and a multi-step round's later steps, ride on lookahead slots; without room
            # for them the request just decodes (and the round takes one step).
            lookahead = len(spec) + out.num_steps - 1
            block_ids = self.kv_manager.allocate_slots(request, num_new, lookahead=lookahead)
            if block_ids is None and lookahead:
                spec = []
                self._single_step(out)
                block_ids = self.kv_manager.allocate_slots(request, num_new)
            while block_ids is None:
                self._single_step(out)  # the victims wait for room: no longer than one step
                victim = mine.pop()
                if mine is not self.running:
                    self.running.remove(victim)
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    # Another micro-batch's requests may hold the blocks: they free them later.
                    if i == 0 and not self.running:
                        raise AssertionError(
                            f"request {request.request_id} cannot get blocks with the whole cache to "
                            "itself; check_fits should have rejected it")
                    return budget
                block_ids = self.kv_manager.allocate_slots(request, num_new)
            out.chunks.append(ScheduledChunk(request, num_new + len(spec), block_ids, spec))
            budget -= num_new + len(spec)
            i += 1
        return budget

    def _single_step(self, out: SchedulerOutput) -> None:
        """Turn ``out`` into a round of one step: the requests already in it give back the
        lookahead blocks they took for the later steps, so that a round that does not fit
        preempts nobody a single step would not."""
        if out.num_steps == 1:
            return
        out.num_steps = 1
        for chunk in out.chunks:
            request = chunk.request
            self.kv_manager.trim(request, request.num_computed_tokens + chunk.num_new_tokens)
            chunk.block_tables = self.kv_manager.get_block_tables(request.request_id)

    def _spec_tokens(self, request: Request, drafts: Optional[Sequence[int]], num_new: int, budget: int) -> list[int]:
        """The drafts this step verifies for ``request``: only on a decode, within the token
        budget, and never more than the length rules could let it keep (the token after the
        last accepted draft is sampled too, hence the -1)."""
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        k = min(len(drafts), budget - 1, max_new_tokens(request, self.max_model_len) - 1)
        return list(drafts[:k]) if k > 0 else []

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, micro_batch: int) -> None:
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.micro_batch != micro_batch or self._waits_for_leader(request):
                deferred.append(self.waiting.popleft())
                continue
            hit_block_ids, num_hit = self.kv_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                # Without chunked prefill a prompt runs whole, in a later step with more room.
                # A preempted request's recompute can outgrow any step; that one is chunked.
                if not self.enable_chunked_prefill and num_new <= self.max_num_batched_tokens:
                    break
                num_new = budget
            block_ids = self.kv_manager.allocate_slots(request, num_new, hit_block_ids, num_hit)
            if block_ids is None:
                if not self.running:
                    raise AssertionError(
                        f"request {request.request_id} cannot get blocks with the whole cache free; "
                        "check_fits should have rejected it")
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new, block_ids))
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))

    def _waits_for_leader(self, request: Request) -> bool:
        """An ``n > 1`` sibling waits until its leader's prompt KV is in the prefix cache."""
        leader = request.prefix_leader
        return (leader is not None and not leader.is_finished
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- async scheduling ------------------------------------------------------------------

    def commit_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """(Async scheduling) ``scheduler_output`` went to the worker: plan the next step as if
        it were done. Its requests' computed tokens count its chunks now, and each chunk that
        samples leaves a placeholder for the token it will produce; ``update_from_output(...,
        committed=True)`` later replaces the placeholders with the tokens."""
        if scheduler_output.num_steps != 1:
            raise ValueError("async scheduling takes one step per round")
        for chunk in scheduler_output.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new_tokens
            if chunk.needs_sample:
                request.num_output_placeholders += 1

    def may_preempt(self, micro_batch: int = 0) -> bool:
        """Whether scheduling ``micro_batch`` now could preempt a running request: the blocks
        its running requests could need for their next chunks (each its whole remaining
        known-and-placeholder tokens, no sliding-window release counted) exceed the free pool.
        Async scheduling collects the step in flight first then: a request is never preempted
        with a token on its way (that token, and a seeded request's RNG draw, would be lost)."""
        kv = self.kv_manager
        needed = 0
        for request in self.running_in(micro_batch):
            target = kv.num_blocks_for(request.num_tokens_with_placeholders)
            needed += sum(max(0, target - len(table)) for table in kv.get_block_tables(request.request_id))
        return needed > kv.num_free_blocks

    # ---- results ---------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: Mapping[str, Union[int, Sequence[int]]],
                           on_token: Optional[Callable[[Request, int], bool]] = None,
                           committed: bool = False) -> list[Request]:
        """Advance each scheduled request, append its new tokens, finish and free stopped ones.

        ``sampled`` maps a request id to its new token, or to the list of tokens a
        speculating request accepted (its accepted drafts, then the token sampled after
        them). Rejected drafts are rolled back: ``num_computed_tokens`` and the block table
        shrink to the KV that holds accepted tokens. This is the one place that decides a
        request is finished: after each appended token, ``on_token(request, j)`` (the j-th
        new token of this step; the detokenizer's stop strings) and then the token rules of
        ``stopping.check_token_stop``; a stop in the middle of an accepted run ends the
        request there and drops the rest.

        ``committed``: the step's progress was counted when it was sent (``commit_in_flight``,
        async scheduling): its sampled tokens replace the placeholders it left.

        Returns the requests that got new tokens, finished or not.
        """
        with_new_token: list[Request] = []
        any_finished = False
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule() and now
            needs_sample = chunk.needs_sample
            if committed:
                if needs_sample:
                    request.num_output_placeholders -= 1
            else:
                request.num_computed_tokens += chunk.num_new_tokens
            if not needs_sample:
                continue
            new_tokens = sampled[request.request_id]
            if isinstance(new_tokens, int):
                new_tokens = (new_tokens,)
            num_drafts = len(chunk.spec_token_ids)
            if scheduler_output.num_steps > 1:
                # Every step of the round computed one more of the request's tokens.
                if len(new_tokens) != scheduler_output.num_steps:
                    raise ValueError(f"request {request.request_id}: {len(new_tokens)} tokens for "
                                     f"{scheduler_output.num_steps} steps")
                request.num_computed_tokens += len(new_tokens) - 1
            elif not 1 <= len(new_tokens) <= num_drafts + 1:
                raise ValueError(f"request {request.request_id}: {len(new_tokens)} tokens for "
                                 f"{num_drafts} drafts")
            num_rejected = max(0, num_drafts + 1 - len(new_tokens))
            if num_rejected:
                # The rejected drafts' KV is garbage: forget it, and the blocks only it used.
                request.num_computed_tokens -= num_rejected
                self.kv_manager.trim(request, request.num_computed_tokens)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            status: Optional[RequestStatus] = None
            for j, token in enumerate(new_tokens):
                request.output_token_ids.append(token)
                if on_token is not None and on_token(request, j):
                    status = RequestStatus.FINISHED_STOPPED
                else:
                    status = check_token_stop(request, self.max_model_len)
                if status is not None:
                    break
            if scheduler_output.num_steps > 1:
                # The round filled blocks past the ones allocation found full: make them
                # findable now, before a finish frees them or a sliding group releases them.
                self.kv_manager.cache_computed_blocks(request)
            if status is not None:
                self._finish(request, status)
                any_finished = True
            with_new_token.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return with_new_token

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish waiting or running requests now (abort, stop string); unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                finished.append(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._micro_batch_load[request.micro_batch] -= 1
        request.status = status
        request.finished_time = time.monotonic()
        if self.before_free is not None:
            self.before_free(request)
        self.kv_manager.free(request)
        del self._requests[request.request_id]
