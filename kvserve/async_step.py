"""Async scheduling (vLLM's): the engine keeps one step in flight in the worker process and
does its own work for the neighbouring steps meanwhile.

One call of ``AsyncStepLoop.step`` with step N in flight:

1. schedule step N+1 and build its inputs, planning with placeholders for the tokens step N
   will sample (``Scheduler.commit_in_flight``); send it. A decode whose input is such a token
   carries a placeholder the worker fills with the token it sampled itself
   (``ChunkInput.feeds_last_sampled``): the engine never waits for a token to send a step.
2. collect step N (the worker has meanwhile moved on to N+1's forward pass) and apply it:
   placeholders become tokens, grammars advance, detokenize, stop strings, EOS, length.
3. send the late bitmasks of N+1's constrained requests, built from the grammars just
   advanced; the worker reads them after N+1's forward pass, before sampling. Only the
   constrained requests wait, and only for the engine's grammar step, never for a forward.

A request that ends at step N (EOS, a stop string, its grammar's end) was also in N+1: that
step's token for it is discarded (``update_from_output`` skips finished requests) and its
blocks were freed when step N finished it; the worker forgets it with the step after. A
request that ends at N by length is not planned into N+1 at all.

Why the worker feeds the sampled token (and not the engine after waiting for it): the wait
would put the engine's whole scheduling and input building back between the worker's steps,
which is what this mode removes; the worker already holds each request's token history
(penalties, min_tokens) and now appends its own samples to it, so one token per decode is all
it substitutes. The grammar cannot do without the real token: its bitmask is the one input
sent late, and the forward pass hides that wait.

Where the next step could preempt a running request (the KV pool is short), the step in
flight is collected first: a preempted request must not lose a token on its way (nor a seeded
request an RNG draw), so preemption only ever happens with nothing in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from kvserve.batch import SchedulerOutput
from kvserve.executor.builder import StepBuilder
from kvserve.executor.multiproc import MultiprocExecutor
from kvserve.executor.step import StepInput, StepOutput
from kvserve.scheduler import Scheduler


@dataclass
class InFlightStep:
    """The step the worker is computing, as scheduled and as sent."""

    sched: SchedulerOutput
    step: StepInput


class AsyncStepLoop:
    def __init__(self, scheduler: Scheduler, executor: MultiprocExecutor, step_builder: StepBuilder,
                 schedule: Callable[[], SchedulerOutput]) -> None:
        """``schedule``: the engine's scheduling of the next step."""
        self.scheduler = scheduler
        self.executor = executor
        self.step_builder = step_builder
        self._schedule = schedule
        self.in_flight: Optional[InFlightStep] = None
        # Steps whose predecessor was collected before they were scheduled (a short KV pool).
        self.num_collected_first = 0

    def step(self, apply: Callable[[SchedulerOutput, StepOutput], None]) -> bool:
        """Send the next step and apply the one in flight (see the module's notes) with
        ``apply`` (the engine's application of a step's output, its progress committed when it
        was sent); True when a step was applied."""
        previous, self.in_flight = self.in_flight, None
        applied = previous is not None
        if previous is not None and self.scheduler.may_preempt():
            apply(previous.sched, self.executor.collect())
            previous = None
            self.num_collected_first += 1
        sched = self._schedule()
        if not sched.is_empty:
            step = self.step_builder.build(sched)
            self.executor.submit(step)
            self.scheduler.commit_in_flight(sched)
            self.in_flight = InFlightStep(sched, step)
        if previous is not None:
            apply(previous.sched, self.executor.collect())
        if self.in_flight is not None and self.in_flight.step.late_grammar_request_ids:
            late = set(self.in_flight.step.late_grammar_request_ids)
            requests = [c.request for c in self.in_flight.sched.chunks if c.request.request_id in late]
            self.executor.send_late_bitmasks(self.step_builder.late_bitmasks(requests))
        return applied
