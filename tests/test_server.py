"""The OpenAI-compatible server, driven over real HTTP (uvicorn on a loopback port) with the
official ``openai`` client and httpx.

Most tests use an in-process server on the tiny random model and compare its greedy output
with the offline ``LLM`` API on the same model; one test runs ``kvserve serve`` as a user
does, on the real default model (API key, back-pressure, chat).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from conftest import track_engine
from kvserve import SamplingParams
from kvserve.async_engine import AsyncLLMEngine
from kvserve.config import ConfigError, EngineArgs
from kvserve.engine import LLMEngine
from kvserve.server.app import create_app, load_chat_template

MODEL = "tiny-llama"
MAX_LEN = 512
TINY_ARGS = dict(model=MODEL, max_model_len=MAX_LEN)
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Hello, my name is"]


# ---------------------------------------------------------------------- harness
class ServerThread:
    """uvicorn serving ``app`` on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples by name (labels appended as name{k=v}) -> value."""
    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture(scope="module")
def tiny():
    engine = LLMEngine(EngineArgs(**TINY_ARGS))
    track_engine(engine)  # conftest checks after every test: no request or block left behind
    async_engine = AsyncLLMEngine(engine)
    with ServerThread(create_app(async_engine, MODEL)) as server:
        yield SimpleNamespace(url=server.url, engine=engine, async_engine=async_engine,
                              client=openai_client(server.url))
    async_engine.shutdown()


@pytest.fixture(scope="module")
def offline(llm_factory):
    """The same model through the offline API: the reference for the server's outputs."""
    return llm_factory(**TINY_ARGS)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------- basics
def test_models_health_openapi(tiny):
    models = tiny.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].chat_template is True
    assert httpx.get(tiny.url + "/health").status_code == 200
    spec = httpx.get(tiny.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                 "/detokenize"):
        assert path in spec["paths"]
    missing = httpx.get(tiny.url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_docs_pages_load_their_assets_from_the_server(tiny):
    """/docs and /redoc work offline: every script and style they load is served here."""
    for page in ("/docs", "/redoc"):
        html = httpx.get(tiny.url + page).text
        assets = re.findall(r'(?:src|href)=["\']([^"\']+\.(?:js|css))', html)
        assert assets and all(a.startswith("/") for a in assets), (page, assets)
        for asset in assets:
            assert httpx.get(tiny.url + asset).status_code == 200, asset


def test_completion_matches_offline_streamed_or_not(tiny, offline):
    prompt = PROMPTS[0]
    ref = offline.generate(prompt, greedy(20))[0].outputs[0]
    resp = tiny.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.created > 0
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    n_prompt = len(offline.tokenizer.encode(prompt))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, len(ref.token_ids))
    assert resp.usage.total_tokens == n_prompt + len(ref.token_ids)

    chunks = list(tiny.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    # The usage chunk is the last one, with no choices, and only that one carries usage.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline_streamed_or_not(tiny, offline):
    messages = chat_messages("What is the capital of France?")
    ref = offline.chat(messages, greedy(24))[0]
    resp = tiny.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                               temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)

    chunks = list(tiny.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)

    # Chat content as a list of text parts is the same conversation.
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    joined = offline.chat(chat_messages("What is the capital\nof France?"), greedy(24))[0]
    resp = tiny.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=24,
                                               temperature=0)
    assert resp.choices[0].message.content == joined.outputs[0].text


def test_n_choices_seed_and_stop_strings(tiny, offline):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0)
    a = tiny.client.completions.create(n=2, seed=1234, **kw)
    b = tiny.client.completions.create(n=2, seed=1234, **kw)
    c = tiny.client.completions.create(n=2, seed=99, **kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seed reproducibility
    assert a.choices[0].text != a.choices[1].text  # siblings draw distinct streams
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert a.usage.completion_tokens == 24
    # The same seeded request through the offline API gives the same samples.
    ref = offline.generate(PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=12))[0]
    assert [ch.text for ch in a.choices] == [o.text for o in ref.outputs]

    # Streaming n=2: every choice's deltas add up to its non-streamed text.
    texts = ["", ""]
    for chunk in tiny.client.completions.create(n=2, seed=1234, stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in a.choices]

    # Stop strings: cut before the stop string, finish_reason "stop", streamed or not.
    full = offline.generate(PROMPTS[1], greedy(24, ignore_eos=True))[0].outputs[0].text
    words = full.split()
    stop = next((w for w in words if w != words[0]), None)  # the first word that is new
    assert stop, f"the output {full!r} needs two distinct words for this check to mean anything"
    cut = full[:full.find(stop)]
    resp = tiny.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24,
                                          temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in tiny.client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut
    chat = tiny.client.chat.completions.create(model=MODEL, messages=chat_messages("Hi"),
                                               max_tokens=16, n=2, temperature=0)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy twins


def test_logprobs_in_both_shapes_match_the_engine(tiny, offline):
    ref = offline.generate(PROMPTS[2], greedy(10, logprobs=3, ignore_eos=True))[0].outputs[0]
    resp = tiny.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10,
                                          temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for token_id, entry, value, top in zip(ref.token_ids, ref.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert 3 <= len(top) <= 4
        # Greedy picks the most likely token: its logprob is the best of the top ones.
        assert value == pytest.approx(max(top.values()), abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chat_ref = offline.chat(chat_messages("Count to five."), greedy(10, logprobs=2, ignore_eos=True))[0].outputs[0]
    resp = tiny.client.chat.completions.create(model=MODEL, messages=chat_messages("Count to five."),
                                               max_tokens=10, temperature=0, logprobs=True,
                                               top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 10
    special = set(offline.tokenizer.hf.all_special_ids)
    for token_id, entry, item in zip(chat_ref.token_ids, chat_ref.logprobs, content):
        assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.bytes == list(offline.tokenizer.decode([token_id], skip_special_tokens=False).encode()) \
            or "\\x" in item.token  # a token holding part of a character shows escaped bytes
    visible = b"".join(bytes(item.bytes) for item, t in zip(content, chat_ref.token_ids) if t not in special)
    assert visible.decode("utf-8", errors="replace") == resp.choices[0].message.content

    # Streamed logprobs arrive with their tokens and add up to the same list.
    streamed = [item for chunk in tiny.client.chat.completions.create(
        model=MODEL, messages=chat_messages("Count to five."), max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices and chunk.choices[0].logprobs for item in chunk.choices[0].logprobs.content]
    assert [(i.token, round(i.logprob, 5)) for i in streamed] == [(i.token, round(i.logprob, 5)) for i in content]


def test_batch_prompts_token_ids_and_echo(tiny, offline):
    singles = [r.outputs[0].text for r in offline.generate(PROMPTS[:2], greedy(8))]
    resp = tiny.client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8,
                                          temperature=0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [singles[0], singles[0], singles[1], singles[1]]
    ids = offline.tokenizer.encode(PROMPTS[0])
    by_ids = tiny.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == singles[0]
    batch_ids = tiny.client.completions.create(model=MODEL, prompt=[ids, offline.tokenizer.encode(PROMPTS[1])],
                                               max_tokens=8, temperature=0)
    assert [c.text for c in batch_ids.choices] == singles
    echo = tiny.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                          temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[0] + singles[0]
    streamed = "".join(c.choices[0].text for c in tiny.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, echo=True, stream=True))
    assert streamed == PROMPTS[0] + singles[0]


def test_echo_text_offsets_skip_what_the_echo_omits(tiny, offline):
    """Each token's text starts at its text_offset in the returned text: a special token the
    echo leaves out (a BOS) takes no room, and the offsets never go backwards."""
    special = offline.tokenizer.hf.all_special_ids[0]
    ids = offline.tokenizer.encode(PROMPTS[0])
    for prompt, skipped in (([special] + ids, 1), (PROMPTS[0], 0)):
        for stream in (False, True):
            kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                      logprobs=1, extra_body={"ignore_eos": True})
            if stream:
                chunks = list(tiny.client.completions.create(stream=True, **kw))
                text = "".join(c.choices[0].text for c in chunks)
                offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
                tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            else:
                choice = tiny.client.completions.create(**kw).choices[0]
                text, offsets, tokens = choice.text, choice.logprobs.text_offset, choice.logprobs.tokens
            n_prompt = len(ids) + skipped
            assert len(offsets) == n_prompt + 6 and text.startswith(PROMPTS[0])
            assert offsets == sorted(offsets) and offsets[:skipped + 1] == [0] * (skipped + 1)
            for token, offset in zip(tokens[skipped:n_prompt], offsets[skipped:n_prompt]):
                assert text[offset:].startswith(token), (token, offset, text)
            assert offsets[n_prompt] == len(PROMPTS[0])  # the first generated token


def test_extra_sampling_fields_reach_the_engine(tiny, offline):
    params = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)
    extras = dict(top_k=20, min_p=0.05, repetition_penalty=1.3)
    ref = offline.generate(PROMPTS[3], SamplingParams(**params, **extras))[0].outputs[0]
    plain = offline.generate(PROMPTS[3], SamplingParams(**params))[0].outputs[0]
    assert ref.text != plain.text, "the extras must change the samples for this check to mean anything"
    resp = tiny.client.completions.create(model=MODEL, prompt=PROMPTS[3], extra_body=extras, **params)
    assert resp.choices[0].text == ref.text
    # max_completion_tokens (chat) and logit_bias: a huge bias forces that token.
    forced = offline.tokenizer.encode(" banana", add_special_tokens=False)[0]
    resp = tiny.client.chat.completions.create(model=MODEL, messages=chat_messages("Hi"),
                                               max_completion_tokens=3, temperature=0,
                                               logit_bias={str(forced): 100})
    assert resp.usage.completion_tokens == 3
    assert resp.choices[0].message.content == offline.tokenizer.decode([forced] * 3)


def test_tokenize_and_detokenize(tiny, offline):
    text = "Hello world, 你好 🙂"
    resp = httpx.post(tiny.url + "/tokenize", json={"prompt": text}).json()
    assert resp["tokens"] == offline.tokenizer.encode(text)
    assert resp["count"] == len(resp["tokens"]) and resp["max_model_len"] == MAX_LEN
    back = httpx.post(tiny.url + "/detokenize", json={"tokens": resp["tokens"]}).json()
    assert back["prompt"] == offline.tokenizer.decode(resp["tokens"])
    messages = chat_messages("What is the capital of France?")
    chat_tokens = httpx.post(tiny.url + "/tokenize", json={"messages": messages}).json()
    assert chat_tokens["tokens"] == offline.chat_prompt_ids(messages)
    bad = httpx.post(tiny.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


# ---------------------------------------------------------------------- cancellation
def _idle_kv(url: str) -> float:
    m = scrape(url)
    assert m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
    return m["kvserve:kv_cache_usage_perc"]


def pace_engine_steps(tiny, monkeypatch, seconds: float = 0.01) -> None:
    """A pause of ``seconds`` after each engine step's outputs for the rest of the test: a
    request that runs to the context (~500 steps) then outlasts the test's checks on a loaded
    machine, where the tiny model's steps alone could finish it before the client leaves. The
    pause is in the loop's delivery, outside the engine lock (which tokenizing takes)."""
    deliver = tiny.async_engine._deliver

    def paced_deliver(request_id, item):
        time.sleep(seconds)
        return deliver(request_id, item)

    monkeypatch.setattr(tiny.async_engine, "_deliver", paced_deliver)


def test_closing_a_stream_aborts_and_frees_blocks(tiny, monkeypatch):
    pace_engine_steps(tiny, monkeypatch)
    idle = _idle_kv(tiny.url)
    aborted = scrape(tiny.url)["kvserve:request_aborted_total"]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_LEN - 16, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", tiny.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    assert scrape(tiny.url)["kvserve:num_requests_running"] == 1
                    break  # leaving the iterator early closes the connection
    # The client went away mid-stream: within a second nothing runs and the blocks are back.
    assert wait_until(lambda: scrape(tiny.url)["kvserve:num_requests_running"] == 0, 1.0)
    m = scrape(tiny.url)
    assert m["kvserve:kv_cache_usage_perc"] == idle
    assert m["kvserve:request_aborted_total"] == aborted + 1
    assert tiny.engine.kv_manager.num_used_blocks == 0


def test_client_gone_before_a_non_streamed_answer_aborts(tiny, monkeypatch):
    pace_engine_steps(tiny, monkeypatch)
    aborted = scrape(tiny.url)["kvserve:request_aborted_total"]
    body = json.dumps({"model": MODEL, "messages": chat_messages("Tell me a story."),
                       "temperature": 0, "ignore_eos": True}).encode()  # up to the context
    host, port = tiny.url.removeprefix("http://").split(":")
    # A raw socket, so the test decides exactly when the client goes away: once it runs.
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        assert wait_until(lambda: scrape(tiny.url)["kvserve:num_requests_running"] == 1, 10.0)
    assert wait_until(lambda: scrape(tiny.url)["kvserve:num_requests_running"] == 0, 1.0)
    assert scrape(tiny.url)["kvserve:request_aborted_total"] == aborted + 1
    assert tiny.engine.kv_manager.num_used_blocks == 0


def test_streams_closing_never_stall_health_or_metrics(tiny, monkeypatch):
    """Aborts are queued to the engine thread: the event loop never waits for a step, so
    /health and /metrics answer at once while streams open and close."""
    pace_engine_steps(tiny, monkeypatch)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_LEN - 16, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    worst = {"/health": 0.0, "/metrics": 0.0}
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                for path in worst:
                    t0 = time.monotonic()
                    assert http.get(tiny.url + path).status_code == 200
                    worst[path] = max(worst[path], time.monotonic() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with httpx.Client(timeout=60) as http:
            for i in range(6):
                with http.stream("POST", tiny.url + "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    events = 0
                    for line in resp.iter_lines():
                        events += line.startswith("data: ")
                        if events == 3 + i % 3:
                            break  # closes the stream
    finally:
        stop.set()
        poller.join(timeout=30)
    assert wait_until(lambda: scrape(tiny.url)["kvserve:num_requests_running"] == 0, 2.0)
    assert tiny.engine.kv_manager.num_used_blocks == 0
    # Generous bounds (a loaded 2-core machine); the lock wait this replaced took seconds.
    assert worst["/health"] < 0.5 and worst["/metrics"] < 0.5, worst


def test_a_closed_stream_runs_at_most_one_more_step(tiny, monkeypatch):
    """The abort is applied at the next step boundary: the step in flight when the stream
    closes is the last one that generates for it."""
    pace_engine_steps(tiny, monkeypatch)

    async def three_tokens_then_close() -> int:
        stream = tiny.async_engine.generate(PROMPTS[0], greedy(MAX_LEN - 16, ignore_eos=True))
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()  # queues the abort
        return tiny.engine.counters.generation_tokens

    at_close = asyncio.run(three_tokens_then_close())
    assert wait_until(lambda: tiny.async_engine.stats()["num_running"] == 0, 2.0)
    assert tiny.engine.counters.generation_tokens - at_close <= 1
    assert tiny.engine.kv_manager.num_used_blocks == 0


# ---------------------------------------------------------------------- concurrency
def test_sixteen_concurrent_streams_equal_sequential_runs(tiny):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    kw = dict(model=MODEL, max_tokens=16, temperature=0)
    sequential = [tiny.client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(prompt=prompt, stream=True, **kw)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    before = scrape(tiny.url)["kvserve:e2e_request_latency_seconds_count"]
    steps_before = len(tiny.engine.counters.step_history)
    assert asyncio.run(all_at_once()) == sequential
    assert scrape(tiny.url)["kvserve:e2e_request_latency_seconds_count"] == before + 16
    # The clients shared batches: some engine steps ran several of them together.
    assert max(s.num_seqs for s in tiny.engine.counters.step_history[steps_before:]) > 4


# ---------------------------------------------------------------------- bad input
LONG_TEXT = "word " * (MAX_LEN + 10)
BAD_REQUESTS = [
    # (id, path, raw body or JSON, status, param, message fragment)
    ("malformed-json", "/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None, "malformed JSON"),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    ("lone-surrogate", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content", "UTF-8"),
    ("prompt-wrong-type", "/v1/completions", {"prompt": 42}, 400, "prompt", "valid"),
    ("max-tokens-wrong-type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("messages-wrong-type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "gpt-4"),
    ("unknown-model-chat", "/v1/chat/completions", {"model": "gpt-4", "messages": chat_messages("hi")}, 404, "model", "gpt-4"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("empty-prompt-list", "/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("prompt-too-long", "/v1/completions", {"prompt": LONG_TEXT}, 400, "prompt", "context"),
    ("ids-too-long", "/v1/completions", {"prompt": [100] * (MAX_LEN + 1)}, 400, "prompt", "context"),
    ("chat-too-long", "/v1/chat/completions", {"messages": chat_messages(LONG_TEXT)}, 400, "messages", "context"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-beyond-context", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens", "context"),
    # Above the documented maximum (max_model_len - 1), also when another field is in effect.
    ("max-tokens-above-its-maximum", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens", "context"),
    ("max-tokens-beside-max-completion-tokens", "/v1/chat/completions", {"messages": chat_messages("hi"), "max_completion_tokens": 2, "max_tokens": MAX_LEN}, 400, "max_tokens", "context"),
    ("max-completion-tokens-beyond-context", "/v1/chat/completions", {"messages": chat_messages("hi"), "max_completion_tokens": 10**6}, 400, "max_completion_tokens", "context"),
    ("infinite-temperature", "/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature", "finite"),
    ("negative-temperature", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ("top-p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("top-p-above-one", "/v1/chat/completions", {"messages": chat_messages("hi"), "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("n-too-large", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n", "128"),
    ("token-id-outside-vocab", "/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "prompt", "vocabulary"),
    ("bad-logit-bias", "/v1/completions", {"prompt": "hi", "logit_bias": {"banana": 5}}, 400, "logit_bias.banana", "pattern"),
    ("stream-options-without-stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("top-logprobs-too-many", "/v1/chat/completions", {"messages": chat_messages("hi"), "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", "20"),
    ("non-text-content-part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content", "text"),
    ("not-json-content-type", "/v1/completions", ("text/plain", b'{"prompt": "hi"}'), 400, None, "JSON object"),
    # A parameter the server does not implement is refused by name, never dropped.
    ("unknown-parameter", "/v1/completions", {"prompt": "hi", "foo_bar": 1}, 400, "foo_bar", "Unrecognized request argument"),
    ("unknown-parameter-odd-name", "/v1/completions", {"prompt": "hi", "max-tokens": 1}, 400, "max-tokens", "supplied: max-tokens"),
    ("unknown-key-in-tool-choice", "/v1/chat/completions", {"messages": chat_messages("hi"), "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "f"}, "extra": 1}}, 400, "tool_choice.extra", "Unrecognized"),
    ("max-completion-tokens-on-completions", "/v1/completions", {"prompt": "hi", "max_completion_tokens": 3}, 400, "max_completion_tokens", "Unrecognized"),
    ("guided-json", "/v1/chat/completions", {"messages": chat_messages("hi"), "guided_json": {"type": "object"}}, 400, "guided_json", "use structured_outputs"),
    ("chat-template-override", "/v1/chat/completions", {"messages": chat_messages("hi"), "chat_template": "{{ 1 }}"}, 400, "chat_template", "Unrecognized"),
    ("unknown-stream-option", "/v1/chat/completions", {"messages": chat_messages("hi"), "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400, "stream_options.continuous_usage_stats", "Unrecognized"),
    ("unknown-structured-output", "/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": ["a"], "backend": "x"}}, 400, "structured_outputs.backend", "Unrecognized"),
    ("best-of-above-n", "/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", "best_of may only equal n"),
]


@pytest.mark.parametrize("path,body,status,param,fragment",
                         [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(tiny, path, body, status, param, fragment):
    rejected = scrape(tiny.url)["kvserve:request_rejected_total"]
    if isinstance(body, tuple):
        resp = httpx.post(tiny.url + path, content=body[1], headers={"content-type": body[0]})
    elif isinstance(body, bytes):
        resp = httpx.post(tiny.url + path, content=body, headers={"content-type": "application/json"})
    else:
        # json.dumps keeps a lone surrogate as the escape "\ud800", as a client would send it.
        resp = httpx.post(tiny.url + path, content=json.dumps(body),
                          headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fragment in error["message"], error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert scrape(tiny.url)["kvserve:request_rejected_total"] == rejected + 1
    # ... and the server still answers.
    ok = tiny.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_best_of_equal_to_n_and_unknown_message_keys_are_accepted(tiny):
    """best_of as n (what LangChain's completions client sends) runs as n; the keys a client
    copies back from a response message (refusal, annotations) are content, not parameters."""
    resp = httpx.post(tiny.url + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 2
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "refusal": None, "annotations": []},
                {"role": "user", "content": "again"},
                # as openai-python's parse and stream helpers hand a tool call back
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "index": 0,
                     "function": {"name": "f", "arguments": "{}", "parsed_arguments": None}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    resp = httpx.post(tiny.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_openai_client_raises_clean_errors(tiny):
    with pytest.raises(openai.NotFoundError) as err:
        tiny.client.completions.create(model="nope", prompt="hi")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        tiny.client.chat.completions.create(model=MODEL, messages=chat_messages("hi"), temperature=-1)


def test_cors_preflight_from_allowed_origins_only(tiny):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    # Off by default: no origin is allowed.
    assert "access-control-allow-origin" not in httpx.options(
        tiny.url + "/v1/chat/completions", headers=preflight).headers
    # A second app on the same engine, with --allowed-origins and an API key.
    app = create_app(tiny.async_engine, MODEL, api_key="sekret",
                     allowed_origins=["http://app.example", "http://localhost:3000"])
    with ServerThread(app) as server:
        ok = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        other = httpx.options(server.url + "/v1/chat/completions",
                              headers={**preflight, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # The real request carries the header too, a refusal for a missing key included.
        denied = httpx.get(server.url + "/v1/models", headers={"Origin": "http://app.example"})
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "http://app.example"


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template == load_chat_template(template)
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_chat_to_a_model_without_chat_template():
    engine = LLMEngine(EngineArgs(**TINY_ARGS))
    engine.tokenizer.hf.chat_template = None  # this engine's own tokenizer: now template-less
    async_engine = AsyncLLMEngine(engine)
    try:
        with ServerThread(create_app(async_engine, MODEL)) as server:
            resp = httpx.post(server.url + "/v1/chat/completions",
                              json={"messages": chat_messages("hi")})
            assert resp.status_code == 400
            error = resp.json()["error"]
            assert "no chat template" in error["message"] and error["param"] == "messages"
            assert "--chat-template" in error["message"]
            (card,) = httpx.get(server.url + "/v1/models").json()["data"]
            assert card["chat_template"] is False
            ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200
            # The Responses API is chat underneath; embeddings need no template.
            resp = httpx.post(server.url + "/v1/responses", json={"input": "hi"})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "no_chat_template"
            assert resp.json()["error"]["param"] == "input"
            assert httpx.post(server.url + "/v1/embeddings", json={"input": "hi"}).status_code == 200
    finally:
        async_engine.shutdown()


# ---------------------------------------------------------------------- metrics
def test_metrics_follow_the_requests(tiny):
    before = scrape(tiny.url)
    resp = tiny.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=7,
                                          temperature=0, extra_body={"ignore_eos": True})
    after = scrape(tiny.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvserve:prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("kvserve:generation_tokens_total") == resp.usage.completion_tokens == 7
    assert delta("kvserve:prefix_cache_queries_total") > 0
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"kvserve:{hist}_count") == 1, hist
        assert delta(f"kvserve:{hist}_sum") >= 0
    assert delta("kvserve:inter_token_latency_seconds_count") == 6  # 7 tokens, 6 gaps
    assert delta("kvserve:request_success_total{finished_reason=length}") == 1
    for name in ("kvserve:num_requests_running", "kvserve:num_requests_waiting",
                 "kvserve:kv_cache_usage_perc", "kvserve:num_preemptions_total",
                 "kvserve:prefix_cache_hits_total", "kvserve:request_aborted_total",
                 "kvserve:request_rejected_total"):
        assert name in after
    assert after["kvserve:kv_cache_blocks_total"] == tiny.engine.num_blocks
    # A repeated prompt is served from the prefix cache (only full blocks are cached).
    long_prompt = " ".join(PROMPTS) * 3
    tiny.client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    hits = scrape(tiny.url)["kvserve:prefix_cache_hits_total"]
    tiny.client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert scrape(tiny.url)["kvserve:prefix_cache_hits_total"] > hits


# ---------------------------------------------------------------------- the CLI, real model
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvserve_serve_default_model_with_api_key_and_back_pressure(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    # No --model: the default model. Two sequences at most, two waiting at most.
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port),
                             "--api-key", "sekret", "--max-waiting-requests", "2",
                             "--max-num-seqs", "2", "--max-model-len", "1024"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        def up() -> bool:
            assert proc.poll() is None, open(log_path).read()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, 240), open(log_path).read()
        startup_log = open(log_path).read()
        assert re.search(r"KV cache: \d+ blocks x 16 tokens", startup_log), startup_log

        # API key: /v1/* needs it; /health and /metrics do not.
        denied = httpx.get(url + "/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(url + "/v1/completions", json={"prompt": "hi"},
                           headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert httpx.get(url + "/metrics").status_code == 200
        client = openai_client(url, api_key="sekret")
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]

        # The real model answers a chat request through the official client.
        reply = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0,
                                               messages=chat_messages("What is the capital of France?"),
                                               max_tokens=12)
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length")

        # Back-pressure: 2 running + 2 waiting at most; the rest are told to retry later.
        async def burst() -> list[httpx.Response]:
            headers = {"Authorization": "Bearer sekret"}
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
                return await asyncio.gather(*(
                    http.post("/v1/completions", json={"prompt": f"{PROMPTS[i % 4]} {i}",
                                                       "max_tokens": 8, "temperature": 0,
                                                       "ignore_eos": True})
                    for i in range(16)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            else:
                assert r.json()["choices"][0]["finish_reason"] == "length"
                assert r.json()["usage"]["completion_tokens"] == 8
        metrics = scrape(url)
        assert metrics["kvserve:request_rejected_total"] >= codes.count(429)
        assert metrics["kvserve:num_requests_running"] == 0 and metrics["kvserve:kv_cache_usage_perc"] == 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def kvserve_serve(tmp_path, *args: str):
    """``kvserve serve --model tiny-llama ARGS`` on a free port, up; yields (process, url,
    log path). Killed at the end if still running."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", MODEL,
                                 "--max-model-len", str(MAX_LEN), "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        def up() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(up, 240), log_path.read_text()
        yield proc, url, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _streams_then_sigterm(proc, url: str, num_streams: int, max_tokens: int) -> list:
    """Start ``num_streams`` completion streams, send SIGTERM once each has its first chunk,
    check that new requests are refused while they run, and return each one's events."""
    started = threading.Barrier(num_streams + 1, timeout=120)
    results: list = [None] * num_streams

    def stream(i: int) -> None:
        body = {"prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        started.wait()
        results[i] = events

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    started.wait()
    proc.send_signal(signal.SIGTERM)
    # Draining: a new request is refused with a hint to retry, while the streams go on.
    refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(url + "/health").status_code == 200
    for t in threads:
        t.join(timeout=120)
    return results


def _finish_reasons(events: list[str]) -> list:
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]


def test_kvserve_serve_drains_on_sigterm(tmp_path):
    """SIGTERM: new requests get 503 with Retry-After while the streams in flight run to their
    end; then the process exits 0. Also --chat-template and --allowed-origins as the CLI
    passes them."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    with kvserve_serve(tmp_path, "--shutdown-timeout", "60", "--chat-template", str(template),
                       "--allowed-origins", "http://app.example") as (proc, url, log_path):
        tokens = httpx.post(url + "/tokenize", json={"messages": chat_messages("hi")}).json()["tokens"]
        assert httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"] == "[user] hi\n"
        preflight = httpx.options(url + "/v1/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"

        for events in _streams_then_sigterm(proc, url, num_streams=3, max_tokens=256):
            assert _finish_reasons(events)[-1] == "length"
        assert proc.wait(timeout=60) == 0, log_path.read_text()


def test_kvserve_serve_aborts_what_outlasts_the_shutdown_timeout(tmp_path):
    # A stream of ~4,000 tokens: several seconds even on a fast, quiet machine, where the tiny
    # model writes a few hundred tokens within the half-second timeout.
    long = 4096
    with kvserve_serve(tmp_path, "--shutdown-timeout", "0.5", "--max-model-len", str(long)) as (proc, url, log_path):
        (events,) = _streams_then_sigterm(proc, url, num_streams=1, max_tokens=long - 64)
        reasons = _finish_reasons(events)
        assert reasons[-1] == "abort" and len(reasons) < long - 64
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        assert "aborted 1 request" in log_path.read_text()
