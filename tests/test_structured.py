"""Structured outputs (grammar-constrained decoding), tool calls and prompt logprobs.

Most tests run the random-weight tiny model, whose unconstrained text is noise: whatever
parses and validates does so because of the grammar. The real models check what needs
sense (unbounded schemas closed by the model itself) and numbers (logprobs against HF).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from conftest import track_engine
from json_schemas import random_schemas
from kvserve import SamplingParams
from kvserve.async_engine import AsyncLLMEngine
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import RequestRejected
from kvserve.server import tools
from kvserve.server.app import create_app
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving import ServingContext
from kvserve.structured import StructuredOutputsParams as Spec
from kvserve.structured.grammar import GrammarError
from kvserve.structured.params import close_objects
from test_server import ServerThread, openai_client

MODEL = "tiny-llama"
TINY_ARGS = dict(model=MODEL, max_model_len=1024)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


@pytest.fixture(scope="module")
def engine():
    """An engine stepped by the test itself (the server's engine has its own thread)."""
    engine = LLMEngine(EngineArgs(**TINY_ARGS, kv_cache_memory=96 << 20, max_num_seqs=256))
    track_engine(engine)
    return engine


def run(engine, prompt, params: SamplingParams):
    rid = engine.add_request(None, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


@pytest.fixture(scope="module")
def tiny():
    engine = LLMEngine(EngineArgs(**TINY_ARGS, kv_cache_memory=96 << 20, max_num_seqs=256))
    track_engine(engine)
    async_engine = AsyncLLMEngine(engine)
    with ServerThread(create_app(async_engine, MODEL)) as server:
        yield SimpleNamespace(url=server.url, engine=engine, client=openai_client(server.url))
    async_engine.shutdown()


def post(tiny, path: str, body: dict) -> httpx.Response:
    return httpx.post(tiny.url + path, json={"model": MODEL, **body}, timeout=120)


# ---------------------------------------------------------------------- the spec
def test_spec_kinds_and_strict_closes_objects():
    assert Spec(regex="a+").kind == "regex" and Spec(json_object=True).kind == "json"[:4] + "_object"
    with pytest.raises(RequestRejected, match="exactly one"):
        Spec(regex="a", choice=["x"]).kind
    with pytest.raises(RequestRejected, match="not valid JSON"):
        Spec(json="{not json").validate()
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "list": {"type": "array", "items": {"type": "object"}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    # A property named "properties" is a property, not a keyword.
    assert "additionalProperties" not in closed["properties"]
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left alone
    assert Spec(json=schema, strict=True).cache_key() != Spec(json=schema).cache_key()


def test_grammar_state_accept_rollback_and_cache(engine):
    compiler = engine.grammar_compiler
    spec = Spec(json={"type": "object", "properties": {"n": {"type": "integer"}},
                      "required": ["n"], "additionalProperties": False})
    compiled = compiler.compile(spec)
    assert compiler.compile(Spec(json=dict(spec.json))) is compiled  # cached by content
    state = compiled.new_state()
    text_ids = engine.tokenizer.encode('{"n": 12}', add_special_tokens=False)
    for t in text_ids[:-1]:
        assert state.accept(t)
    assert not state.is_terminated
    state.rollback(2)
    assert state.num_accepted == len(text_ids) - 3
    for t in text_ids[-3:]:
        assert state.accept(t)
    assert state.is_terminated  # the object is closed: only EOS can follow
    other = compiled.new_state()  # states are independent
    assert not other.accept(engine.tokenizer.encode("x", add_special_tokens=False)[0])
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(Spec(regex="a(b"))
    with pytest.raises(ValueError):
        state.rollback(100)


# ---------------------------------------------------------------------- offline
def test_200_random_schemas_parse_and_validate(engine):
    """The bar: 200 schemas of varied shape, every output parses and validates."""
    schemas = random_schemas(200, seed=16)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=600,
                             structured_outputs=Spec(json=s)) for i, s in enumerate(schemas)]
    ids = [engine.add_request(None, "Return a JSON object:", p) for p in params]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    for rid, schema in zip(ids, schemas):
        out = finals[rid]
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_grammar_and_n(engine):
    cases = [(Spec(regex=r"[0-9]{3}-[a-z]{2,4}"), r"^[0-9]{3}-[a-z]{2,4}$"),
             (Spec(choice=["yes", "no", "maybe not"]), r"^(yes|no|maybe not)$"),
             (Spec(grammar='start: "(" num ("," num)~1..3 ")"\nnum: /[1-9][0-9]?/'),
              r"^\([1-9][0-9]?(,[1-9][0-9]?){1,3}\)$"),
             (Spec(grammar='root ::= "<" [a-c] [a-c]? [a-c]? ">"'), r"^<[a-c]{1,3}>$")]  # GBNF
    import re
    for spec, pattern in cases:
        params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=40, structured_outputs=spec)
        final = run(engine, "Answer:", params)
        for c in final.outputs:
            assert c.finish_reason == "stop" and re.match(pattern, c.text), (spec, c.text)


# ---------------------------------------------------------------------- server
def test_response_format_json_schema_streamed_or_not(tiny):
    schema = random_schemas(1, seed=3)[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Describe a thing as JSON."}]
    resp = tiny.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400,
                                               temperature=0, response_format=fmt)
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    chunks = list(tiny.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=400, temperature=0, response_format=fmt,
        stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text

    obj = tiny.client.completions.create(model=MODEL, prompt="JSON:", max_tokens=300, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"},
                                                     "min_tokens": 3})
    assert isinstance(json.loads(obj.choices[0].text), dict) or obj.choices[0].finish_reason == "length"


def test_structured_outputs_field_on_completions(tiny):
    resp = tiny.client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, n=4, seed=1,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert {c.text for c in resp.choices} <= {"red", "green", "blue"}
    resp = tiny.client.completions.create(
        model=MODEL, prompt="Date:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}})
    import re
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", resp.choices[0].text)
    resp = tiny.client.completions.create(
        model=MODEL, prompt="x", max_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"json": json.dumps(TOOL_SCHEMAS["add"])}})
    jsonschema.validate(json.loads(resp.choices[0].text), TOOL_SCHEMAS["add"])


@pytest.mark.parametrize("body, param, fragment", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", ""),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs", "not valid JSON"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "response_format", ""),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
])
def test_bad_grammars_are_400(tiny, body, param, fragment):
    before = tiny.engine.grammar_compiler.num_compiled
    for path, extra in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        resp = post(tiny, path, {**extra, **body, "max_tokens": 4})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and fragment in error["message"]
        assert (error["param"] or "").startswith(param)
    assert tiny.engine.grammar_compiler.num_compiled == before


# ---------------------------------------------------------------------- tools
def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_tool_choice_required_always_gives_a_valid_call(tiny):
    messages = [{"role": "user", "content": "What is 2 + 3, and the weather in Paris?"}]
    resp = tiny.client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, ADD], tool_choice="required",
        max_tokens=300, temperature=1.0, n=12, seed=5, parallel_tool_calls=False)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0])

    # Parallel calls (the default) are an array without an upper bound: a random model never
    # closes it, so the parsing of such an output is checked on text.
    plan = tools.ToolPlan(mode="required", tools=[tools.ChatTool.model_validate(t) for t in (WEATHER, ADD)])
    assert "maxItems" not in plan.spec().json
    calls = tools.forced_calls('[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                               '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]', plan)
    assert [c.function.name for c in calls] == ["add", "get_weather"]
    for call in calls:
        _check_call(call)
    assert tools.forced_calls('[{"name": "add", "arguments": {"a": 1', plan) is None  # cut short
    # Cut by max_tokens: the calls as far as they came (OpenAI's shape, finish_reason "length").
    (call,) = tools.forced_calls('[{"name": "add", "arguments": {"a": 1', plan, truncated=True)
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 1')
    calls = tools.forced_calls('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
                               '"arguments": {"ci', plan, truncated=True)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}'),
                                                                         ("get_weather", '{"ci')]
    (call,) = tools.forced_calls('[{"name": "add"', plan, truncated=True)
    assert (call.function.name, call.function.arguments) == ("add", "")
    assert tools.forced_calls('[{"name": "get_wea', plan, truncated=True) is None  # no name yet
    assert tools.forced_calls('[{"name": "nope", "arguments": {}}, {"na', plan, truncated=True) is None


def test_named_tool_choice_streams_call_deltas(tiny):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3"}], tools=[WEATHER, ADD],
              tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=100,
              temperature=0)
    resp = tiny.client.chat.completions.create(**kw)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "add" and resp.choices[0].finish_reason == "tool_calls"
    _check_call(call)
    chunks = list(tiny.client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].function.name == "add"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_a_forced_call_cut_by_max_tokens_comes_back_as_a_partial_call(tiny):
    """As OpenAI: tool_calls with the arguments so far and finish_reason "length", streamed or
    not, never the call's JSON as content."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3"}], tools=[WEATHER, ADD],
              tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=3, temperature=0)
    resp = tiny.client.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and call.function.arguments.startswith("{")
    chunks = list(tiny.client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["add"]
    assert deltas[0].function.arguments == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)


def test_objects_are_closed_unless_the_schema_opens_them(tiny):
    """vLLM's semantics: tool arguments and json_schema objects without additionalProperties
    take only their properties, whatever ``strict`` says; additionalProperties: true stays open."""
    open_schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["city"]}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": open_schema}}
    resp = tiny.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120, temperature=1.0, n=20, seed=3)
    assert len(resp.choices) == 20
    for choice in resp.choices:
        # Closed, the object is short and ends: an open one may grow keys to max_tokens.
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert set(arguments) <= {"city", "days"} and "city" in arguments, arguments

    # The grammars the server builds: closed by default, for every tool_choice and format.
    plan = tools.ToolPlan(mode="named", tools=[tools.ChatTool.model_validate(weather)], named="get_weather")
    assert plan.spec().schema()["additionalProperties"] is False
    plan.mode = "required"
    assert plan.spec().schema()["items"]["properties"]["arguments"]["additionalProperties"] is False
    opened = {**open_schema, "additionalProperties": True}
    plan.tools = [tools.ChatTool.model_validate({"type": "function", "function": {
        "name": "get_weather", "parameters": opened}})]
    assert plan.spec().schema()["items"]["properties"]["arguments"]["additionalProperties"] is True
    for schema, closed in ((open_schema, False), (opened, True)):
        body = ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "hi"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": False}}})
        _, spec = ServingContext.structured_spec(body)
        assert spec.schema()["additionalProperties"] is closed


def test_auto_tools_prompt_roundtrip_and_errors(tiny):
    # The default rendering puts the tools in the system turn; a tool result goes back.
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    tokens = post(tiny, "/tokenize", {"messages": conversation}).json()["tokens"]
    text = tiny.engine.tokenizer.decode(tokens, skip_special_tokens=False)
    assert "<tools>" not in text and '"name": "get_weather"' in text and "temperature" in text
    resp = tiny.client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER],
                                               max_tokens=8, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert resp.usage.prompt_tokens > len(tokens)  # the tool signatures were added
    for body, fragment in [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
    ]:
        r = post(tiny, "/v1/chat/completions", {"messages": conversation[:1], "max_tokens": 4, **body})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_parse_auto_calls_and_stream_filter():
    plan = tools.ToolPlan(mode="auto", tools=[tools.ChatTool.model_validate(WEATHER)])
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "celsius"}}\n</tool_call>')
    content, calls = tools.parse_auto(text, plan)
    assert content == "Let me check." and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "unit": "celsius"}
    # Unknown functions and broken JSON stay text; an unclosed final block still parses.
    assert tools.parse_auto('<tool_call>{"name": "other", "arguments": {}}</tool_call>', plan)[1] == []
    assert tools.parse_auto("<tool_call>{oops</tool_call>", plan)[1] == []
    assert len(tools.parse_auto('<tool_call>{"name": "get_weather", "arguments": {}}', plan)[1]) == 1
    f = tools.AutoContentFilter()
    streamed = "".join(f.delta(text[:n]) for n in range(1, len(text) + 1))
    assert streamed == "Let me check."


# ---------------------------------------------------------------------- prompt logprobs
def test_echo_logprobs_tiny_consistent_with_generation(tiny):
    prompt = "The capital of France is"
    ids = tiny.engine.tokenizer.encode(prompt)
    resp = post(tiny, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2,
                                          "max_tokens": 1, "temperature": 0}).json()
    lp = resp["choices"][0]["logprobs"]
    assert resp["choices"][0]["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])
    # The prompt prefix's last logprob, asked as a generation, is the same number.
    head = post(tiny, "/v1/completions", {"prompt": ids[:-1], "logprobs": 0, "max_tokens": 1,
                                          "temperature": 0, "logit_bias": {str(ids[-1]): 0}}).json()
    forced = post(tiny, "/v1/completions", {"prompt": ids[:-1], "echo": True, "logprobs": 0,
                                            "max_tokens": 1, "temperature": 0}).json()
    assert forced["choices"][0]["logprobs"]["token_logprobs"][1:len(ids) - 1] == \
        pytest.approx(lp["token_logprobs"][1:len(ids) - 1], abs=1e-5)
    assert head["choices"][0]["logprobs"]["tokens"]
    # Streaming carries the same prompt logprobs in its first chunk.
    with httpx.stream("POST", tiny.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2,
                            "max_tokens": 1, "temperature": 0, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][:len(ids)] == lp["token_logprobs"][:len(ids)]


def test_echo_logprobs_match_hf_fp32():
    """SmolLM2 in the parity mode: prompt logprobs within 1e-3 of HF transformers."""
    import torch
    from hf_reference import hf_model_from_gguf

    from kvserve.loader.resolve import resolve_model

    engine = LLMEngine(EngineArgs(model="smollm2-135m-instruct", dtype="float32",
                                  quantization="none", kv_cache_memory=32 << 20,
                                  max_num_batched_tokens=16))  # several prefill chunks
    track_engine(engine)
    text = ("The KV cache holds the keys and values of every earlier token, so that each "
            "decode step attends over them without recomputing the prompt.")
    ids = engine.tokenizer.encode(text)
    final = run(engine, ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    ours = [entry[t].logprob for entry, t in zip(final.prompt_logprobs[1:], ids[1:])]
    source = resolve_model("smollm2-135m-instruct")
    hf = hf_model_from_gguf(source.path)  # transformers' own GGUF loader (tests/hf_reference.py)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    ref = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert final.prompt_logprobs[0] is None and len(ours) == len(ref)
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-3
