"""Output generator: incremental detokenization, stop strings, logprobs, RequestOutput assembly.

One ``RequestGroup`` per user request; ``n > 1`` requests have n child sequences, each a
``Request`` in the scheduler, whose outputs are reported together under the parent id.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from kvserve.request import CompletionOutput, Logprob, Request, RequestMetrics, RequestOutput
from kvserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass
class SequenceState:
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    stop_matcher: Optional[StopStringMatcher]
    text: str = ""  # final text once stopped (stop string removed)
    emitted_text_len: int = 0
    emitted_token_len: int = 0
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    stopped_by_string: bool = False
    flushed: bool = False

    def visible_text(self) -> str:
        """Text that is safe to show: stop-string truncated, or held back while a stop string
        could still be forming at its end."""
        if self.stopped_by_string:
            return self.text
        if self.request.is_finished and not self.flushed:
            self.detokenizer.finish()  # a character cut by the last token still shows
            self.flushed = True
        full = self.detokenizer.text
        if self.request.is_finished or self.stop_matcher is None:
            return full
        return full[:self.stop_matcher.safe_emit_length(full)]


@dataclass
class RequestGroup:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    arrival_time: float
    final_emitted: bool = False

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.sequences)

    def build_output(self) -> RequestOutput:
        outputs = []
        for seq in self.sequences:
            req = seq.request
            text = seq.visible_text()
            delta_text = text[seq.emitted_text_len:]
            seq.emitted_text_len = len(text)
            delta_ids = req.output_token_ids[seq.emitted_token_len:]
            seq.emitted_token_len = req.num_output_tokens
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(req.output_token_ids),
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                # A copy, like token_ids: the server reads outputs on its own thread while the
                # engine appends to the live list (a shared list ran ahead of its token ids and
                # a streamed logprob went missing).
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob,
                delta_text=delta_text, delta_token_ids=list(delta_ids)))
        first = self.sequences[0].request
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min((s.request.first_scheduled_time for s in self.sequences
                                      if s.request.first_scheduled_time is not None), default=None),
            first_token_time=min((s.request.first_token_time for s in self.sequences
                                  if s.request.first_token_time is not None), default=None),
            finished_time=max((s.request.finished_time or 0.0 for s in self.sequences), default=None)
            if self.finished else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=sum(s.request.num_output_tokens for s in self.sequences),
            num_cached_tokens=first.num_cached_tokens,
        )
        if self.finished:
            self.final_emitted = True
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None] + list(first.prompt_logprobs)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids, outputs=outputs,
                             finished=self.finished, metrics=metrics,
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs,
                             kv_transfer_params=first.kv_transfer_result)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}
        self.seq_by_request_id: dict[str, tuple[RequestGroup, SequenceState]] = {}

    def add_group(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                  requests: list[Request]) -> None:
        seqs = []
        for i, req in enumerate(requests):
            params = req.sampling_params
            matcher = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                       if params.stop else None)
            seq = SequenceState(index=i, request=req,
                                detokenizer=IncrementalDetokenizer(
                                    self.tokenizer, params.skip_special_tokens,
                                    prompt_token_ids=prompt_token_ids),
                                stop_matcher=matcher,
                                logprobs=[] if params.logprobs is not None else None,
                                cumulative_logprob=0.0 if params.logprobs is not None else None)
            seqs.append(seq)
        group = RequestGroup(request_id, prompt, prompt_token_ids, seqs,
                             arrival_time=requests[0].arrival_time)
        self.groups[request_id] = group
        for seq in seqs:
            self.seq_by_request_id[seq.request.request_id] = (group, seq)

    def child_ids(self, request_id: str) -> list[str]:
        group = self.groups.get(request_id)
        return [s.request.request_id for s in group.sequences] if group else []

    def process_new_token(self, request: Request, logprobs: Optional[dict[int, Logprob]]) -> bool:
        """Detokenize the request's newest token; return True if it completes a stop string
        (the scheduler, which owns "finished", then ends the request on this token)."""
        group, seq = self.seq_by_request_id[request.request_id]
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        token_id = request.output_token_ids[-1]
        new_text_len = len(seq.detokenizer.add([token_id]))
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
            chosen = logprobs.get(token_id)
            if chosen is not None:
                seq.cumulative_logprob += chosen.logprob
        stopped = False
        # As vLLM: no stop string ends the output within its first min_tokens tokens (the
        # sampler keeps EOS and stop tokens out of them the same way).
        if (seq.stop_matcher is not None and not seq.stopped_by_string and new_text_len
                and request.num_output_tokens > request.sampling_params.min_tokens):
            hit = seq.stop_matcher.check(seq.detokenizer.text, new_text_len)
            if hit is not None:
                stop_str, truncated = hit
                seq.text = truncated
                seq.stopped_by_string = True
                request.stop_reason = stop_str
                stopped = True
        if request.is_finished or stopped:
            request.finished_time = now
        return stopped

    def add_prompt_logprobs(self, request_id: str, entries: list[dict[int, Logprob]]) -> None:
        entry = self.seq_by_request_id.get(request_id)
        if entry is not None and entry[1].request.prompt_logprobs is not None:
            entry[1].request.prompt_logprobs.extend(entries)

    def mark_finished(self, request: Request) -> None:
        if request.finished_time is None:
            request.finished_time = time.monotonic()

    def outputs_for(self, request_ids: set[str]) -> list[RequestOutput]:
        """Build outputs for the groups owning these child ids; drop finished groups."""
        seen: dict[str, RequestGroup] = {}
        for rid in request_ids:
            entry = self.seq_by_request_id.get(rid)
            if entry is not None:
                seen[entry[0].request_id] = entry[0]
        outputs = []
        for group in seen.values():
            if group.final_emitted:
                continue
            outputs.append(group.build_output())
            if group.finished:
                self._drop(group)
        return outputs

    def _drop(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for seq in group.sequences:
            self.seq_by_request_id.pop(seq.request.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.groups)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups
