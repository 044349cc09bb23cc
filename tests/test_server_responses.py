"""/v1/responses (the Responses API) on the tiny model with the official ``openai`` client:
plain, streamed, ``text.format`` json_schema, function tools and ``previous_response_id``,
each compared with what /v1/chat/completions gives for the same conversation (a response is
a chat completion underneath)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from conftest import track_engine
from kvserve.async_engine import AsyncLLMEngine
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import CompletionOutput, RequestOutput, SamplingParams
from kvserve.server import tools
from kvserve.server.app import create_app
from kvserve.server.chat import PreparedChat
from kvserve.server.metrics import ServerMetrics
from kvserve.server.responses import _ResponseWriter, chat_request
from kvserve.server.responses_protocol import ResponsesRequest
from kvserve.server.response_store import ResponseStore, StoredResponse
from test_server import MAX_LEN, MODEL, TINY_ARGS, ServerThread, openai_client

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"enum": [1, 2, 3]}},
          "required": ["answer", "confidence"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(**TINY_ARGS))
    track_engine(engine)
    async_engine = AsyncLLMEngine(engine)
    with ServerThread(create_app(async_engine, MODEL, response_store_size=8)) as thread:
        yield thread, openai_client(thread.url)
    async_engine.shutdown()


def chat_of(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=max_tokens,
                                          temperature=0)


def test_plain_response_is_the_chat_completion_of_its_conversation(server):
    thread, client = server
    response = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer briefly.",
                                       max_output_tokens=12, temperature=0)
    chat = chat_of(client, [{"role": "system", "content": "Answer briefly."},
                            {"role": "user", "content": "Name a colour."}], 12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 12
    # Stored: GET gives it back.
    stored = httpx.get(f"{thread.url}/v1/responses/{response.id}").json()
    assert stored["id"] == response.id and stored["output"][0]["content"][0]["text"] == response.output_text


def test_streamed_response_events(server):
    thread, client = server
    plain = client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed" if plain.status == "completed" else "response.incomplete"]
    assert kinds == head + ["response.output_text.delta"] * len(deltas) + tail
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.output_text == plain.output_text and final.status == plain.status
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert events[-4].text == plain.output_text


def test_json_schema_text_format(server):
    thread, client = server
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": ANSWER, "strict": True}}
    response = client.responses.create(model=MODEL, input="Is the sky blue?", text=fmt, temperature=0,
                                       max_output_tokens=60)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert response.text.format.type == "json_schema" and response.text.format.name == "verdict"
    streamed = "".join(e.delta for e in client.responses.create(
        model=MODEL, input="Is the sky blue?", text=fmt, temperature=0, max_output_tokens=60, stream=True)
        if e.type == "response.output_text.delta")
    assert streamed == response.output_text
    anything = client.responses.create(model=MODEL, input="Some JSON", temperature=0, max_output_tokens=40,
                                       text={"format": {"type": "json_object"}}, extra_body={"seed": 3})
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)


def test_the_sdks_parse_and_stream_helpers(server):
    """openai's responses.parse (a pydantic text_format) and responses.stream, whose state
    machine checks the events' order and assembles the final response from them."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confidence: Literal[1, 2, 3]

    thread, client = server
    parsed = client.responses.parse(model=MODEL, input="Is it?", text_format=Verdict, temperature=0,
                                    max_output_tokens=50)
    assert isinstance(parsed.output_parsed, Verdict)
    with client.responses.stream(model=MODEL, input="Is it?", text_format=Verdict, temperature=0,
                                 max_output_tokens=50) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and deltas == final.output_text == parsed.output_text


def test_function_tools_and_their_results(server):
    thread, client = server
    # (one call: the tiny random model would otherwise go on adding calls to the array)
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False, temperature=0,
                                       max_output_tokens=80)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), {**WEATHER["parameters"], "additionalProperties": False})
    # A named function, streamed: the call comes as one output item with its arguments.
    events = list(client.responses.create(
        model=MODEL, input="Weather in Oslo?", tools=[WEATHER], temperature=0, max_output_tokens=80,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    (item,) = events[-1].response.output
    assert item.type == "function_call" and json.loads(item.arguments) == json.loads(events[-3].arguments)
    # The call and its output sent back (the items as the client has them): a response.
    follow = client.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=8,
        input=[{"role": "user", "content": "Weather in Paris?"}, calls[0],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > response.usage.input_tokens


def test_previous_response_id_continues_the_conversation(server):
    thread, client = server
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be kind.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # The earlier turns come back; the earlier instructions do not (OpenAI's rule).
    chat = chat_of(client, [{"role": "user", "content": "My name is Ada."},
                            {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "What is my name?"}], 6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # Not stored: not found later.
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    assert httpx.get(f"{thread.url}/v1/responses/{unstored.id}").status_code == 404


def test_response_store_keeps_the_most_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse([], {"id": name}))
    assert store.get("a") is not None  # "a" used: "b" is now the oldest
    store.put("c", StoredResponse([], {"id": "c"}))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2


@pytest.mark.parametrize("body,status,param,fragment", [
    pytest.param({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "not found", id="unknown-previous"),
    pytest.param({"input": "x", "max_output_tokens": MAX_LEN}, 400, "max_output_tokens", "context", id="max-output-tokens"),
    pytest.param({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", "greater than", id="max-output-tokens-zero"),
    pytest.param({"input": []}, 400, "input", "", id="empty-input"),
    pytest.param({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input", "input_image", id="image-item"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input", "", id="file-part"),
    pytest.param({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, 400, "text.format", "bogus", id="bad-schema"),
    pytest.param({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format", "schema", id="schema-missing"),
    pytest.param({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice", "other", id="unknown-tool"),
    pytest.param({"input": "x", "tool_choice": "required"}, 400, "tool_choice", "tools", id="choice-without-tools"),
    pytest.param({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning", "Unrecognized", id="reasoning"),
    pytest.param({"input": "x", "temperature": 3}, 400, "temperature", "2", id="temperature"),
    pytest.param({"input": "word " * (MAX_LEN + 10)}, 400, "input", "context", id="too-long"),
])
def test_bad_responses_requests_get_a_clear_error(server, body, status, param, fragment):
    thread, client = server
    resp = httpx.post(thread.url + "/v1/responses", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert client.responses.create(model=MODEL, input="ok", max_output_tokens=2).status in ("completed", "incomplete")


def test_auto_tool_calls_come_as_function_call_items_streamed_or_not():
    """tool_choice auto: the text before a ``<tool_call>`` block streams as output_text (a tail
    that may open a block held back), the block becomes a function_call item, and the answer
    not streamed has the same items. A scripted output: the tiny random model writes no calls."""
    pieces = ["Let me check.", " <tool", '_call>{"name": "get_weather", ',
              '"arguments": {"city": "Paris", "unit": "c"}}</tool_call>']
    outputs, text = [], ""
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        outputs.append(RequestOutput("resp_x", None, [1, 2, 3], [CompletionOutput(
            0, text, list(range(k + 1)), finish_reason="stop" if last else None, delta_text=piece)], last))

    class Scripted:
        async def __aiter__(self):
            for output in outputs:
                yield 0, output

    body = ResponsesRequest.model_validate({"input": "Weather?", "tools": [WEATHER]})
    turns = [{"role": "user", "content": "Weather?"}]
    chat = PreparedChat([1, 2, 3], SamplingParams(max_tokens=50), tools.plan_tools(chat_request(body, turns)))
    assert chat.plan.mode == "auto"
    ctx = SimpleNamespace(metrics=ServerMetrics(lambda: {}), model_name=MODEL)

    async def run():
        streamed = [e async for e in _ResponseWriter(ctx, ResponseStore(), body, chat, "resp_s", turns).events(Scripted())]
        whole = await _ResponseWriter(ctx, ResponseStore(), body, chat, "resp_w", turns).collect(Scripted())
        return streamed, json.loads(whole.body)

    streamed, whole = asyncio.run(run())
    events = [json.loads(e.split("data: ", 1)[1]) for e in streamed]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Let me check. "
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    for response in (final, whole):
        message, call = response["output"]
        assert message["content"][0]["text"] == "Let me check. "
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "c"}
        assert response["usage"]["output_tokens"] == len(pieces)
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.done")
