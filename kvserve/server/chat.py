"""POST /v1/chat/completions: the model's chat template, then generation, streamed or not."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from kvserve.request import RequestOutput, SamplingParams
from kvserve.server.errors import APIError, bad_request, error_body
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.protocol import (ChatCompletionChoice, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatCompletionStreamChoice,
                                     ChatCompletionStreamResponse, ChatResponseMessage,
                                     DeltaMessage, UsageInfo)
from kvserve.server.serving import SSE_DONE, OutputObserver, ServingContext, sse
from kvserve.server.streams import EngineJob, EngineStreams, respond


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest,
                                 raw_request: Request) -> Response | ChatCompletionResponse:
    ctx.check_model(body.model)
    ctx.check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    params = ctx.sampling_params(body)
    prompt_ids = await ctx.chat_prompt_ids(body.messages, bool(body.add_generation_prompt))
    explicit_max = body.max_completion_tokens is not None or body.max_tokens is not None
    params = ctx.fit_to_context(params, len(prompt_ids), "messages", explicit_max)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = EngineStreams(ctx.async_engine, [EngineJob(prompt_ids, params, request_id)],
                            raw_request, ctx.gate)
    return await respond(streams, _ChatWriter(ctx, body, params, request_id, len(prompt_ids)),
                         bool(body.stream))


@dataclass
class _ChatWriter:
    ctx: ServingContext
    body: ChatCompletionRequest
    params: SamplingParams
    request_id: str
    num_prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))

    def _usage(self, final: Optional[RequestOutput]) -> UsageInfo:
        completion = sum(len(c.token_ids) for c in final.outputs) if final else 0
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                         total_tokens=self.num_prompt_tokens + completion)

    def _logprobs(self, entries, token_ids):
        return chat_logprobs(entries, token_ids, self.params.logprobs or 0, self.ctx.token_text)

    async def collect(self, streams: EngineStreams) -> ChatCompletionResponse:
        observe = OutputObserver(self.ctx.metrics)
        final: Optional[RequestOutput] = None
        async for job_index, output in streams:
            observe(job_index, output)
            if output.finished:
                final = output
        choices = [ChatCompletionChoice(
            index=c.index, message=ChatResponseMessage(role="assistant", content=c.text),
            logprobs=(self._logprobs(c.logprobs or [], c.token_ids)
                      if self.params.logprobs is not None else None),
            finish_reason=c.finish_reason) for c in final.outputs]
        return ChatCompletionResponse(id=self.request_id, created=self.created,
                                      model=self.ctx.model_name, choices=choices,
                                      usage=self._usage(final))

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage: Optional[UsageInfo] = None) -> str:
        payload = ChatCompletionStreamResponse(id=self.request_id, created=self.created,
                                               model=self.ctx.model_name, choices=choices,
                                               usage=usage).model_dump(mode="json")
        for choice in payload["choices"]:
            # OpenAI leaves unset delta fields out rather than sending nulls.
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(payload)

    async def events(self, streams: EngineStreams) -> AsyncIterator[str]:
        observe = OutputObserver(self.ctx.metrics)
        # The role comes first, in a chunk of its own for each choice, as OpenAI sends it.
        for i in range(self.params.n):
            yield self._chunk([ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(role="assistant", content=""))])
        logprobs_sent = [0] * self.params.n
        finished = [False] * self.params.n
        final: Optional[RequestOutput] = None
        try:
            async for job_index, output in streams:
                observe(job_index, output)
                final = output
                for c in output.outputs:
                    if finished[c.index]:
                        continue
                    logprobs = None
                    if self.params.logprobs is not None:
                        new = (c.logprobs or [])[logprobs_sent[c.index]:]
                        if new:
                            start = logprobs_sent[c.index]
                            logprobs = self._logprobs(new, c.token_ids[start:start + len(new)])
                            logprobs_sent[c.index] += len(new)
                    if not c.delta_text and logprobs is None and c.finish_reason is None:
                        continue
                    finished[c.index] = c.finish_reason is not None
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=DeltaMessage(content=c.delta_text or None),
                        logprobs=logprobs, finish_reason=c.finish_reason)])
            if self.body.include_usage_chunk:
                yield self._chunk([], usage=self._usage(final))
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:  # the engine failed mid-stream: say so in the stream
            yield sse(error_body(f"generation failed: {exc}", type="server_error"))
        yield SSE_DONE
