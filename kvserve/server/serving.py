"""What the completion and chat handlers share: the engine, request checks that answer
before anything is queued, tokenization off the event loop, and per-output bookkeeping."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from pydantic import BaseModel

from kvserve.config import ConfigError
from kvserve.request import RequestOutput, RequestRejected, SamplingParams
from kvserve.server.errors import APIError, bad_request
from kvserve.server.metrics import ServerMetrics
from kvserve.server import tools
from kvserve.server.protocol import ChatMessage, CompletionRequest, SamplingRequest
from kvserve.server.tools import ToolPlan
from kvserve.structured import StructuredOutputsParams
from kvserve.server.streams import AdmissionGate
from kvserve.server.token_text import TokenText

T = TypeVar("T")


def sse(payload: Any) -> str:
    """One server-sent event carrying ``payload`` (a pydantic model or plain JSON data)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_text(text: str, param: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which are not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} is not valid UTF-8 text (it holds a lone surrogate)",
                          param=param) from None
    return text


@dataclass
class ServingContext:
    async_engine: Any  # kvserve.async_engine.AsyncLLMEngine
    model_name: str
    metrics: ServerMetrics
    gate: Optional[AdmissionGate] = None

    def __post_init__(self) -> None:
        engine = self.async_engine.engine
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.token_text = TokenText(engine.tokenizer)

    # ------------------------------------------------------------------ engine access
    async def in_engine(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(engine, *args)`` under the engine lock, off the event loop, so that
        tokenizing a long prompt does not stall the other streams."""
        return await asyncio.to_thread(self.async_engine.call, fn, *args)

    # ------------------------------------------------------------------ request checks
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")

    @staticmethod
    def check_best_of(body: CompletionRequest) -> None:
        n = 1 if body.n is None else body.n
        if body.best_of is not None and body.best_of != n:
            raise bad_request(f"best_of {body.best_of} with n {n} is not supported: kvserve returns every "
                              f"sample it generates (best_of may only equal n)", param="best_of")

    @staticmethod
    def check_stream_options(body: SamplingRequest) -> None:
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")

    def sampling_params(self, body: SamplingRequest) -> SamplingParams:
        self.check_max_tokens(body)
        try:
            params = body.to_sampling_params()
        except ValueError as exc:
            raise bad_request(str(exc), param="logit_bias") from None
        for stop in params.stop:
            check_text(stop, "stop")
        try:
            params.validate(self.vocab_size)
        except RequestRejected as exc:
            raise bad_request(str(exc)) from None
        return params

    def check_max_tokens(self, body: SamplingRequest) -> None:
        """The bound /openapi.json states (max_model_len - 1: the prompt takes a token) holds for
        each field given, also the one not in effect (max_tokens beside max_completion_tokens)."""
        limit = self.max_model_len - 1
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(body, name, None)
            if value is not None and value > limit:
                raise bad_request(f"{name} is {value}, above {limit}: this model's context is "
                                  f"{self.max_model_len} tokens, the prompt included",
                                  param=name, code="context_length_exceeded")

    @staticmethod
    def structured_spec(body: SamplingRequest) -> Optional[tuple[str, StructuredOutputsParams]]:
        """(the parameter that asked, the grammar spec) from response_format or
        structured_outputs; None for free text."""
        specs = []
        fmt = body.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise bad_request("response_format of type json_schema needs a json_schema "
                                  "object ({name, schema, strict})", param="response_format")
            # Objects are closed whatever ``strict`` says (vLLM's semantics: a key outside the
            # schema breaks the client's parse); a schema that says additionalProperties: true
            # stays open.
            specs.append(("response_format", StructuredOutputsParams(
                json=fmt.json_schema.json_schema, strict=True)))
        so = body.structured_outputs
        if so is not None:
            fields: dict[str, Any] = {name: value for name, value in
                                      (("json", so.json_), ("regex", so.regex),
                                       ("choice", so.choice), ("grammar", so.grammar))
                                      if value is not None}
            if so.json_object:
                fields["json_object"] = True
            if len(fields) != 1:
                raise bad_request("structured_outputs needs exactly one of json, regex, choice, "
                                  f"grammar, json_object (got {sorted(fields) or 'none'})",
                                  param="structured_outputs")
            specs.append(("structured_outputs", StructuredOutputsParams(**fields)))
        if len(specs) > 1:
            raise bad_request("give response_format or structured_outputs, not both",
                              param="structured_outputs")
        return specs[0] if specs else None

    async def compile_grammar(self, spec: StructuredOutputsParams, param: str) -> None:
        """Compile (or find in the cache) off the event loop, so that the engine's own
        compile at admission is a cache hit; a spec that does not compile is a 400."""
        compiler = self.async_engine.engine.grammar_compiler
        try:
            await asyncio.to_thread(compiler.compile, spec)
        except RequestRejected as exc:
            raise bad_request(str(exc), param=param, code="invalid_grammar") from None

    def fit_to_context(self, params: SamplingParams, num_prompt_tokens: int, param: str,
                       max_tokens_param: Optional[str]) -> SamplingParams:
        """Refuse a prompt that leaves no room to generate, or an explicit max_tokens beyond
        the context (``max_tokens_param``: the field the client set it with, None for the
        default); a default max_tokens is shortened to fit instead."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(f"the prompt has {num_prompt_tokens} tokens, but this model's "
                              f"context is {limit} tokens and must leave room for at least one "
                              f"generated token", param=param, code="context_length_exceeded")
        room = limit - num_prompt_tokens
        if params.max_tokens is None or params.max_tokens <= room:
            return params
        if max_tokens_param is not None:
            raise bad_request(f"{max_tokens_param} is {params.max_tokens}, but the prompt has "
                              f"{num_prompt_tokens} tokens and this model's context is {limit} "
                              f"tokens, leaving room for {room}", param=max_tokens_param,
                              code="context_length_exceeded")
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    # ------------------------------------------------------------------ tokenization
    async def tokenize(self, text: str, param: str) -> list[int]:
        check_text(text, param)
        if not text:
            raise bad_request(f"{param} is empty", param=param)
        ids = await self.in_engine(lambda engine: engine.tokenizer.encode(text))
        if not ids:  # a tokenizer without byte fallback can drop every character
            raise bad_request(f"{param} has no tokens: the tokenizer keeps nothing of its text",
                              param=param)
        return ids

    async def chat_prompt_ids(self, messages: list[ChatMessage],
                              add_generation_prompt: bool = True,
                              tool_plan: Optional[ToolPlan] = None) -> list[int]:
        if not messages:
            raise bad_request("messages must hold at least one message", param="messages")
        conversation = [chat_message_dict(m, i) for i, m in enumerate(messages)]

        def render(engine) -> list[int]:
            tokenizer = engine.tokenizer
            if not tokenizer.has_chat_template:
                raise bad_request(f"model {self.model_name} has no chat template, so it cannot "
                                  f"serve chat requests: start the server with --chat-template "
                                  f"FILE|STRING, or use /v1/completions", param="messages",
                                  code="no_chat_template")
            native = tools.template_takes_tools(tokenizer.hf.chat_template)
            turns = tools.messages_for_template(conversation, native)
            extra = {}
            if tool_plan is not None and tool_plan.renders_tools:
                if native:
                    extra["tools"] = tools.tool_dicts(tool_plan)
                else:
                    turns = tools.add_default_tool_prompt(turns, tool_plan)
            try:
                # The template carries BOS where the model wants one; so no special tokens.
                text = tokenizer.apply_chat_template(turns, add_generation_prompt, **extra)
                return tokenizer.encode(text, add_special_tokens=False)
            except ConfigError as exc:
                raise bad_request(str(exc), param="messages", code="no_chat_template") from None
            except RequestRejected as exc:  # the template refused the conversation
                raise bad_request(str(exc), param="messages") from None

        return await self.in_engine(render)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                              f"(size {self.vocab_size})", param="tokens")
        return await self.in_engine(
            lambda engine: engine.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def chat_message_dict(message: ChatMessage, index: int) -> dict:
    """A message as chat templates expect it: content a plain string (text parts joined)."""
    content = message.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{index}]: content parts of type {part.type!r} are "
                                  f"not supported; only text parts are",
                                  param=f"messages.{index}.content")
            texts.append(part.text)
        text = "\n".join(texts)
    out: dict[str, Any] = {"role": message.role,
                           "content": check_text(text, f"messages.{index}.content")}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump(mode="json") for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


class OutputObserver:
    """Feeds the latency metrics from the outputs a handler receives."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last_time: dict[int, float] = {}

    def __call__(self, job_index: int, output: RequestOutput) -> None:
        now = time.monotonic()
        # Sibling sequences (n > 1) advance together: count tokens per sequence.
        new_tokens = max((len(c.delta_token_ids) for c in output.outputs), default=0)
        if new_tokens:
            last = self._last_time.get(job_index)
            if last is not None:
                self._metrics.observe_token_gap(now - last, new_tokens)
            self._last_time[job_index] = now
        if output.finished:
            self._metrics.observe_finished(output)
