"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}.

A response is a chat completion underneath: the input items become chat turns (after the
stored conversation of ``previous_response_id``, with ``instructions`` as the system turn),
``text.format`` becomes the response format and function tools become chat tools, and the
request runs through the chat endpoint's checks, template and grammar (chat.prepare_chat).
What differs is the output's shape: a list of output items (an assistant ``message`` with
``output_text``, ``function_call`` items), a status instead of a finish reason, and, streamed,
typed events (response.created ... response.output_text.delta ... response.completed)
instead of chunks.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvserve.request import RequestOutput
from kvserve.server import tools
from kvserve.server.chat import PreparedChat, finished_message, prepare_chat
from kvserve.server.errors import APIError, bad_request, error_body
from kvserve.server.protocol import ChatCompletionRequest, ToolCall
from kvserve.server.response_store import ResponseStore, StoredResponse
from kvserve.server.responses_protocol import (FunctionCallItem, FunctionCallOutputItem,
                                               InputMessage, InputTextPart, ResponsesRequest)
from kvserve.server.serving import OutputObserver, ServingContext
from kvserve.server.streams import EngineJob, EngineStreams, respond

# The chat request's parameter names, as this endpoint's client knows them.
_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "tools": "tools", "tool_choice": "tool_choice"}


# ---------------------------------------------------------------------- input
def _text(content: str | list[InputTextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def input_turns(items: str | list) -> list[dict[str, Any]]:
    """The input as chat turns: messages as they are ("developer" is the chat templates'
    "system"), a model's function calls as an assistant turn with ``tool_calls`` (calls in a
    row, or after that turn's text, join it), their outputs as ``tool`` turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    turns: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            turns.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            turns.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return turns


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request this response runs as."""
    fields: dict[str, Any] = {
        "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "parallel_tool_calls": body.parallel_tool_calls, "stream": bool(body.stream)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.name is None or fmt.json_schema is None:
            raise bad_request("text.format of type json_schema needs a name and a schema",
                              param="text.format")
        fields["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            by_alias=True, exclude={"type"}, exclude_none=True)}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # (the fields were checked as this endpoint's already)
        first = exc.errors()[0]
        raise bad_request(f"input: {first['msg']}", param="input") from None


# ---------------------------------------------------------------------- the endpoint
async def create_response(ctx: ServingContext, store: ResponseStore, body: ResponsesRequest,
                          raw_request: Request) -> Response:
    ctx.check_model(body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found: "
                                f"this server keeps the last {store.capacity} stored responses in "
                                f"memory; send the conversation as input instead",
                           param="previous_response_id", code="previous_response_not_found")
        history = stored.conversation
    limit = ctx.max_model_len - 1
    if body.max_output_tokens is not None and body.max_output_tokens > limit:
        raise bad_request(f"max_output_tokens is {body.max_output_tokens}, above {limit}: this model's "
                          f"context is {ctx.max_model_len} tokens, the input included",
                          param="max_output_tokens", code="context_length_exceeded")
    turns = history + input_turns(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    try:
        chat = await prepare_chat(ctx, chat_request(body, system + turns))
    except APIError as exc:  # named as this endpoint names them
        if exc.param is not None:
            head, _, rest = exc.param.partition(".")
            if head in _PARAMS:
                exc.message = exc.message.replace(head, _PARAMS[head])
                exc.param = _PARAMS[head] + ("." + rest if rest and head != "messages" else "")
        raise
    response_id = f"resp_{uuid.uuid4().hex}"
    streams = EngineStreams(ctx.async_engine, [EngineJob(chat.prompt_ids, chat.params, response_id)],
                            raw_request, ctx.gate)
    writer = _ResponseWriter(ctx, store, body, chat, response_id, turns)
    return await respond(streams, writer, bool(body.stream))


async def get_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found (this server keeps the last "
                            f"{store.capacity} stored responses in memory)", param="response_id",
                       code="response_not_found")
    return stored.response


# ---------------------------------------------------------------------- output
def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: ToolCall, status: str, arguments: Optional[str] = None) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.function.name,
            "arguments": call.function.arguments if arguments is None else arguments, "status": status}


_STATUS = {"length": "incomplete", "abort": "cancelled"}


@dataclass
class _ResponseWriter:
    ctx: ServingContext
    store: ResponseStore
    body: ResponsesRequest
    chat: PreparedChat
    response_id: str
    turns: list[dict[str, Any]]  # the conversation before this response (no instructions)
    created: float = field(default_factory=time.time)
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    def _response(self, status: str, output: list[dict[str, Any]], final: Optional[RequestOutput] = None,
                  error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        body, params = self.body, self.chat.params
        usage = None
        if final is not None:
            generated = len(final.outputs[0].token_ids)
            prompt = len(self.chat.prompt_ids)
            usage = {"input_tokens": prompt,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                     "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + generated}
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "model": self.ctx.model_name, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) or choice is None else choice.model_dump())
            or ("auto" if body.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "metadata": body.metadata or {}, "usage": usage, "user": body.user,
        }

    def _finish(self, final: RequestOutput, text: str, calls: list[ToolCall],
                finish_reason: Optional[str]) -> dict[str, Any]:
        """The finished response object (stored unless ``store`` is false)."""
        status = _STATUS.get(finish_reason or "", "completed")
        item_status = "incomplete" if status != "completed" else "completed"
        output = [_message_item(self.message_id, text, item_status)] if text else []
        output += [_call_item(call, item_status) for call in calls]
        response = self._response(status, output, final)
        if self.body.store is not False:
            turn: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = [c.model_dump(mode="json") for c in calls]
            self.store.put(self.response_id, StoredResponse(self.turns + [turn], response))
        return response

    async def collect(self, streams: EngineStreams) -> JSONResponse:
        observe = OutputObserver(self.ctx.metrics)
        final: Optional[RequestOutput] = None
        async for job_index, output in streams:
            observe(job_index, output)
            if output.finished:
                final = output
        completion = final.outputs[0]
        content, calls, finish_reason = finished_message(self.chat.plan, completion.text,
                                                         completion.finish_reason)
        return JSONResponse(self._finish(final, content or "", calls, finish_reason))

    async def events(self, streams: EngineStreams) -> AsyncIterator[str]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

        plan = self.chat.plan
        observe = OutputObserver(self.ctx.metrics)
        # With tools in auto mode, text that may be a call is held back, as in chat streams.
        held = tools.AutoContentFilter() if plan.mode == "auto" and plan.renders_tools else None
        sent: list[str] = []
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}

        def text_delta(delta: str) -> list[str]:
            out = []
            if not sent:  # the message item opens with its first text
                out.append(event("response.output_item.added", output_index=0,
                                 item=_message_item(self.message_id, "", "in_progress")))
                out.append(event("response.content_part.added", **where, part={
                    "type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            sent.append(delta)
            out.append(event("response.output_text.delta", **where, delta=delta, logprobs=[]))
            return out

        yield event("response.created", response=self._response("in_progress", []))
        yield event("response.in_progress", response=self._response("in_progress", []))
        try:
            final: Optional[RequestOutput] = None
            async for job_index, output in streams:
                observe(job_index, output)
                completion = output.outputs[0]
                delta = ("" if plan.forced else held.delta(completion.text) if held is not None
                         else completion.delta_text)
                if delta:
                    for line in text_delta(delta):
                        yield line
                if output.finished:
                    final = output
            completion = final.outputs[0]
            content, calls, finish_reason = finished_message(plan, completion.text, completion.finish_reason)
            # What was held back: the text after the calls, a tail that was no call, or a
            # forced output that did not parse as calls (sent as the text it is).
            if held is not None:
                rest = held.rest(content) if calls else completion.text[held.sent:]
            else:
                rest = completion.text if plan.forced and not calls else ""
            if rest:
                for line in text_delta(rest):
                    yield line
            text = "".join(sent)
            response = self._finish(final, text, calls, finish_reason)
            if text:
                item = response["output"][0]
                yield event("response.output_text.done", **where, text=text, logprobs=[])
                yield event("response.content_part.done", **where, part=item["content"][0])
                yield event("response.output_item.done", output_index=0, item=item)
            first_call = 1 if text else 0
            for k, item in enumerate(response["output"][first_call:], start=first_call):
                yield event("response.output_item.added", output_index=k,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                            name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                response["status"], "response.failed")
            yield event(kind, response=response)
        except Exception as exc:  # the engine failed mid-stream: say so in the stream
            error = exc.body()["error"] if isinstance(exc, APIError) else \
                error_body(f"generation failed: {exc}", type="server_error")["error"]
            yield event("response.failed", response=self._response(
                "failed", [], error={"code": error.get("code") or error["type"], "message": error["message"]}))
