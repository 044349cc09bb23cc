"""POST /v1/chat/completions: the model's chat template, then generation, streamed or not."""
from __future__ import annotations

import dataclasses
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
                                     DeltaFunctionCall, DeltaMessage, DeltaToolCall, ToolCall,
                                     UsageInfo)
from kvserve.server import tools
from kvserve.server.serving import SSE_DONE, OutputObserver, ServingContext, sse
from kvserve.server.streams import EngineJob, EngineStreams, respond


@dataclass
class PreparedChat:
    """A chat request checked and rendered: what the engine runs, and how tools are served."""

    prompt_ids: list[int]
    params: SamplingParams
    plan: tools.ToolPlan


async def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> PreparedChat:
    """Every check a chat request gets before it is queued (400s), its grammar compiled, its
    conversation rendered by the chat template (with the tools where they are shown) and its
    max_tokens fitted to the context. /v1/responses serves through this too."""
    ctx.check_model(body.model)
    ctx.check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    params = ctx.sampling_params(body)
    plan = tools.plan_tools(body)
    structured = ctx.structured_spec(body)
    if plan.forced:
        if structured is not None:
            raise bad_request(f"tool_choice {plan.mode!r} constrains the output itself; it "
                              f"cannot be combined with {structured[0]}", param=structured[0])
        try:
            structured = ("tools", plan.spec())
        except KeyError as exc:
            raise bad_request(f"unknown tool {exc}", param="tool_choice") from None
    if structured is not None:
        await ctx.compile_grammar(structured[1], structured[0])
        params = dataclasses.replace(params, structured_outputs=structured[1])
    prompt_ids = await ctx.chat_prompt_ids(body.messages, bool(body.add_generation_prompt), plan)
    max_tokens_param = ("max_completion_tokens" if body.max_completion_tokens is not None
                        else "max_tokens" if body.max_tokens is not None else None)
    params = ctx.fit_to_context(params, len(prompt_ids), "messages", max_tokens_param)
    return PreparedChat(prompt_ids, params, plan)


def finished_message(plan: tools.ToolPlan, text: str, finish_reason: Optional[str]
                     ) -> tuple[Optional[str], list[ToolCall], Optional[str]]:
    """(content, tool calls, finish reason) of one finished choice: forced calls parsed from
    the constrained output, auto calls from the ``<tool_call>`` blocks in the text."""
    calls: list[ToolCall] = []
    content: Optional[str] = text
    if plan.forced:
        calls = tools.forced_calls(text, plan, truncated=finish_reason == "length") or []
        if calls:
            content = None
    elif plan.mode == "auto":
        content, calls = tools.parse_auto(text, plan)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return content, calls, finish_reason


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest,
                                 raw_request: Request) -> Response | ChatCompletionResponse:
    chat = await prepare_chat(ctx, body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = EngineStreams(ctx.async_engine, [EngineJob(chat.prompt_ids, chat.params, request_id)],
                            raw_request, ctx.gate)
    writer = _ChatWriter(ctx, body, chat.params, request_id, len(chat.prompt_ids), chat.plan)
    return await respond(streams, writer, bool(body.stream))


@dataclass
class _ChatWriter:
    ctx: ServingContext
    body: ChatCompletionRequest
    params: SamplingParams
    request_id: str
    num_prompt_tokens: int
    plan: tools.ToolPlan
    created: int = field(default_factory=lambda: int(time.time()))

    def _message(self, text: str, finish_reason: Optional[str]
                 ) -> tuple[Optional[str], list[ToolCall], Optional[str]]:
        """(content, tool calls, finish reason) of one finished choice."""
        return finished_message(self.plan, text, finish_reason)

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
        choices = []
        for c in final.outputs:
            content, calls, finish_reason = self._message(c.text, c.finish_reason)
            choices.append(ChatCompletionChoice(
                index=c.index, message=ChatResponseMessage(role="assistant", content=content,
                                                           tool_calls=calls or None),
                logprobs=(self._logprobs(c.logprobs or [], c.token_ids)
                          if self.params.logprobs is not None else None),
                finish_reason=finish_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created,
                                      model=self.ctx.model_name, choices=choices,
                                      usage=self._usage(final), kv_transfer_params=final.kv_transfer_params)

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
        # With tools, content is held back where it may be a call (auto) or is one (forced).
        filters = [tools.AutoContentFilter() for _ in range(self.params.n)]
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
                    delta_text = c.delta_text
                    finish_reason = c.finish_reason
                    calls: list[ToolCall] = []
                    if self.plan.forced:
                        delta_text = ""
                    elif self.plan.mode == "auto":
                        delta_text = filters[c.index].delta(c.text)
                    if finish_reason is not None and self.plan.renders_tools:
                        content, calls, finish_reason = self._message(c.text, finish_reason)
                        if self.plan.mode == "auto":
                            delta_text += filters[c.index].rest(content) if calls else \
                                c.text[filters[c.index].sent:]
                        elif not calls:
                            delta_text = c.text  # not a complete call: the text as it is
                    if not delta_text and logprobs is None and finish_reason is None:
                        continue
                    finished[c.index] = finish_reason is not None
                    if calls:
                        if delta_text or logprobs is not None:
                            yield self._chunk([ChatCompletionStreamChoice(
                                index=c.index, delta=DeltaMessage(content=delta_text or None),
                                logprobs=logprobs)])
                        # Each call whole, in one delta (id, name and arguments together).
                        yield self._chunk([ChatCompletionStreamChoice(
                            index=c.index, delta=DeltaMessage(tool_calls=[
                                DeltaToolCall(index=k, id=call.id, type="function",
                                              function=DeltaFunctionCall(
                                                  name=call.function.name,
                                                  arguments=call.function.arguments))
                                for k, call in enumerate(calls)]),
                            finish_reason=finish_reason)])
                        continue
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=DeltaMessage(content=delta_text or None),
                        logprobs=logprobs, finish_reason=finish_reason)])
            if self.body.include_usage_chunk:
                yield self._chunk([], usage=self._usage(final))
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:  # the engine failed mid-stream: say so in the stream
            yield sse(error_body(f"generation failed: {exc}", type="server_error"))
        yield SSE_DONE
