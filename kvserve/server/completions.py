"""POST /v1/completions: one prompt or a batch (strings or token ids), streamed or not."""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import Response

from kvserve.request import RequestOutput, SamplingParams
from kvserve.server.errors import APIError, bad_request, error_body
from kvserve.server.logprobs import completion_logprobs, concat_completion_logprobs
from kvserve.server.protocol import (CompletionChoice, CompletionRequest, CompletionResponse,
                                     UsageInfo)
from kvserve.server.serving import SSE_DONE, OutputObserver, ServingContext, sse
from kvserve.server.streams import EngineJob, EngineStreams, respond


@dataclass
class _Prompt:
    text: Optional[str]  # None for token-id prompts
    token_ids: list[int]


async def _prompts(ctx: ServingContext, prompt: Union[str, list]) -> list[_Prompt]:
    """Normalise OpenAI's four prompt forms into a list of tokenized prompts."""
    if isinstance(prompt, str):
        return [_Prompt(prompt, await ctx.tokenize(prompt, "prompt"))]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [_Prompt(None, _check_ids(ctx, prompt, "prompt"))]
    out = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(_Prompt(item, await ctx.tokenize(item, f"prompt.{i}")))
        else:
            out.append(_Prompt(None, _check_ids(ctx, item, f"prompt.{i}")))
    return out


def _check_ids(ctx: ServingContext, token_ids: list[int], param: str) -> list[int]:
    if not token_ids:
        raise bad_request(f"{param} is empty", param=param)
    bad = [t for t in token_ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise bad_request(f"{param}: token id {bad[0]} is outside the vocabulary "
                          f"(size {ctx.vocab_size})", param=param)
    return list(token_ids)


async def create_completion(ctx: ServingContext, body: CompletionRequest,
                            raw_request: Request) -> Response | CompletionResponse:
    ctx.check_model(body.model)
    ctx.check_stream_options(body)
    ctx.check_best_of(body)
    params = ctx.sampling_params(body)
    if body.echo and body.logprobs is not None:
        # The prompt's own logprobs come back with the echoed prompt (lm-eval's loglikelihood).
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    structured = ctx.structured_spec(body)
    if structured is not None:
        await ctx.compile_grammar(structured[1], structured[0])
        params = dataclasses.replace(params, structured_outputs=structured[1])
    prompts = await _prompts(ctx, body.prompt)
    if body.kv_transfer_params is not None and len(prompts) != 1:
        raise bad_request("kv_transfer_params needs a single prompt", param="kv_transfer_params")
    max_tokens_param = None if body.max_tokens is None else "max_tokens"
    per_prompt = [ctx.fit_to_context(params, len(p.token_ids), "prompt", max_tokens_param) for p in prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    jobs = [EngineJob(p.token_ids, sp, f"{request_id}-{i}")
            for i, (p, sp) in enumerate(zip(prompts, per_prompt))]
    echoes = [await _echo_text(ctx, p, params) if body.echo else "" for p in prompts]

    streams = EngineStreams(ctx.async_engine, jobs, raw_request, ctx.gate)
    return await respond(streams, _CompletionWriter(ctx, body, params, request_id, prompts, echoes),
                         bool(body.stream))


async def _echo_text(ctx: ServingContext, prompt: _Prompt, params: SamplingParams) -> str:
    if prompt.text is not None:
        return prompt.text
    return await ctx.decode(prompt.token_ids, params.skip_special_tokens)


@dataclass
class _ChoiceState:
    echo: str
    logprobs_sent: int = 0
    text_offset: int = 0
    finished: bool = False


@dataclass
class _CompletionWriter:
    ctx: ServingContext
    body: CompletionRequest
    params: SamplingParams
    request_id: str
    prompts: list[_Prompt]
    echoes: list[str]
    created: int = field(default_factory=lambda: int(time.time()))

    def _choice_index(self, job_index: int, seq_index: int) -> int:
        return job_index * self.params.n + seq_index

    def _usage(self, finals: list[Optional[RequestOutput]]) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for out in finals if out for c in out.outputs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    async def collect(self, streams: EngineStreams) -> CompletionResponse:
        observe = OutputObserver(self.ctx.metrics)
        finals: list[Optional[RequestOutput]] = [None] * len(self.prompts)
        async for job_index, output in streams:
            observe(job_index, output)
            if output.finished:
                finals[job_index] = output
        choices = []
        for job_index, output in enumerate(finals):
            echo = self.echoes[job_index]
            for c in output.outputs:
                logprobs = None
                if self.params.logprobs is not None:
                    logprobs, _ = completion_logprobs(c.logprobs or [], c.token_ids,
                                                      self.params.logprobs, self.ctx.token_text,
                                                      text_offset=len(echo))
                    prompt = self._prompt_logprobs(job_index, output)
                    if prompt is not None:
                        logprobs = concat_completion_logprobs(prompt, logprobs)
                choices.append(CompletionChoice(index=self._choice_index(job_index, c.index),
                                                text=echo + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason))
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=self.request_id, created=self.created,
                                  model=self.ctx.model_name, choices=choices,
                                  usage=self._usage(finals), kv_transfer_params=finals[0].kv_transfer_params)

    async def events(self, streams: EngineStreams) -> AsyncIterator[str]:
        observe = OutputObserver(self.ctx.metrics)
        states: dict[int, _ChoiceState] = {}
        finals: list[Optional[RequestOutput]] = [None] * len(self.prompts)
        try:
            async for job_index, output in streams:
                observe(job_index, output)
                finals[job_index] = output
                for c in output.outputs:
                    index = self._choice_index(job_index, c.index)
                    state = states.setdefault(index, _ChoiceState(echo=self.echoes[job_index],
                                                                  text_offset=len(self.echoes[job_index])))
                    chunk = self._chunk(state, index, c, job_index, output)
                    if chunk is not None:
                        yield sse(chunk)
            if self.body.include_usage_chunk:
                yield sse(CompletionResponse(id=self.request_id, created=self.created,
                                             model=self.ctx.model_name, choices=[],
                                             usage=self._usage(finals)))
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:  # the engine failed mid-stream: say so in the stream
            yield sse(error_body(f"generation failed: {exc}", type="server_error"))
        yield SSE_DONE

    def _prompt_logprobs(self, job_index: int, output: RequestOutput):
        """The echoed prompt's logprobs (first token null), when asked for; their offsets
        count the echoed text only."""
        if self.params.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        prompt, echo = self.prompts[job_index], self.echoes[job_index]
        logprobs, _ = completion_logprobs(output.prompt_logprobs, prompt.token_ids,
                                          self.params.prompt_logprobs, self.ctx.token_text,
                                          omitted=self._omitted(prompt), text_length=len(echo))
        return logprobs

    def _omitted(self, prompt: _Prompt) -> set[int]:
        """Positions of the prompt's special tokens that its echo leaves out: those the
        tokenizer added to a text prompt (BOS), or all of them when the echo of a token-id
        prompt was decoded without them."""
        special = self.ctx.token_text.special_ids
        if prompt.text is None and not self.params.skip_special_tokens:
            return set()
        return {i for i, t in enumerate(prompt.token_ids) if t in special
                and (prompt.text is None or self.ctx.token_text.text(t) not in prompt.text)}

    def _chunk(self, state: _ChoiceState, index: int, c, job_index: int,
               output: RequestOutput) -> Optional[CompletionResponse]:
        if state.finished:
            return None
        text = c.delta_text
        prompt_logprobs = None
        if state.echo:
            text, state.echo = state.echo + text, ""
            prompt_logprobs = self._prompt_logprobs(job_index, output)
        logprobs = None
        if self.params.logprobs is not None:
            new = (c.logprobs or [])[state.logprobs_sent:]
            ids = c.token_ids[state.logprobs_sent:state.logprobs_sent + len(new)]
            if new:
                logprobs, state.text_offset = completion_logprobs(
                    new, ids, self.params.logprobs, self.ctx.token_text, state.text_offset)
                state.logprobs_sent += len(new)
            if prompt_logprobs is not None:
                logprobs = (concat_completion_logprobs(prompt_logprobs, logprobs)
                            if logprobs is not None else prompt_logprobs)
        if not text and logprobs is None and c.finish_reason is None:
            return None
        state.finished = c.finish_reason is not None
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.ctx.model_name,
            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=c.finish_reason)])
