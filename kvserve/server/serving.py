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
from kvserve.server.protocol import ChatMessage, SamplingRequest
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
    def check_stream_options(body: SamplingRequest) -> None:
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")

    def sampling_params(self, body: SamplingRequest) -> SamplingParams:
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

    def fit_to_context(self, params: SamplingParams, num_prompt_tokens: int, param: str,
                       max_tokens_given: bool) -> SamplingParams:
        """Refuse a prompt that leaves no room to generate, or an explicit max_tokens beyond
        the context; a default max_tokens is shortened to fit instead."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(f"the prompt has {num_prompt_tokens} tokens, but this model's "
                              f"context is {limit} tokens and must leave room for at least one "
                              f"generated token", param=param, code="context_length_exceeded")
        room = limit - num_prompt_tokens
        if params.max_tokens is None or params.max_tokens <= room:
            return params
        if max_tokens_given:
            raise bad_request(f"max_tokens is {params.max_tokens}, but the prompt has "
                              f"{num_prompt_tokens} tokens and this model's context is {limit} "
                              f"tokens, leaving room for {room}", param="max_tokens",
                              code="context_length_exceeded")
        return dataclasses.replace(params, max_tokens=room)

    # ------------------------------------------------------------------ tokenization
    async def tokenize(self, text: str, param: str) -> list[int]:
        check_text(text, param)
        if not text:
            raise bad_request(f"{param} is empty", param=param)
        return await self.in_engine(lambda engine: engine.tokenizer.encode(text))

    async def chat_prompt_ids(self, messages: list[ChatMessage],
                              add_generation_prompt: bool = True) -> list[int]:
        conversation = [chat_message_dict(m, i) for i, m in enumerate(messages)]

        def render(engine) -> list[int]:
            tokenizer = engine.tokenizer
            if not tokenizer.has_chat_template:
                raise bad_request(f"model {self.model_name} has no chat template, so it cannot "
                                  f"serve chat requests; use /v1/completions", param="messages",
                                  code="no_chat_template")
            try:
                # The template carries BOS where the model wants one; encode_chat adds none.
                return tokenizer.encode_chat(conversation, add_generation_prompt)
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
    out = {"role": message.role, "content": check_text(text, f"messages.{index}.content")}
    if message.name is not None:
        out["name"] = message.name
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
