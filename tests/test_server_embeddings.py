"""/v1/embeddings on the tiny model, through the official ``openai`` client and raw HTTP; the
vectors are checked against the model's own forward run here (one prefill, a KV cache of the
test's own), mean-pooled and normalised."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from conftest import track_engine
from kvserve.async_engine import AsyncLLMEngine
from kvserve.attention import build_attention_metadata
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.kv_cache import allocate_kv_cache
from kvserve.server.app import create_app
from test_server import MAX_LEN, MODEL, TINY_ARGS, ServerThread, openai_client

TEXTS = ["The capital of France is", "Once upon a time there was a cache", "def add(a, b):"]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(**TINY_ARGS))
    track_engine(engine)
    async_engine = AsyncLLMEngine(engine)
    with ServerThread(create_app(async_engine, MODEL)) as thread:
        yield thread, engine, openai_client(thread.url)
    async_engine.shutdown()


def reference_embedding(engine: LLMEngine, token_ids: list[int]) -> np.ndarray:
    """The model's forward over the whole prompt in one prefill, into an fp32 KV cache of its
    own: the final norm's output at every position, averaged, scaled to unit length."""
    model, block_size = engine.model, 16
    num_blocks = -(-len(token_ids) // block_size)
    kv = allocate_kv_cache(engine.model_config, num_blocks, block_size, torch.float32, "cpu")
    metadata = build_attention_metadata([list(range(num_blocks))], [0], [len(token_ids)], block_size)
    with torch.inference_mode():
        hidden = model.model(torch.tensor(token_ids), torch.arange(len(token_ids)), metadata, kv, None)
        mean = model.model.norm(hidden).double().mean(dim=0).numpy()
    return mean / np.linalg.norm(mean)


def test_embeddings_with_the_openai_client_match_the_models_forward(server):
    thread, engine, client = server
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    # The client asks for base64 (float32 bytes) unless told otherwise.
    result = client.embeddings.create(model=MODEL, input=TEXTS)
    assert result.model == MODEL and [d.index for d in result.data] == [0, 1, 2]
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    vectors = np.array([d.embedding for d in result.data])
    assert vectors.shape == (3, engine.model_config.hidden_size)
    for vector, token_ids in zip(vectors, ids):
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        # (the engine's KV cache is bf16 in the default mode, the reference's fp32)
        np.testing.assert_allclose(vector, reference_embedding(engine, token_ids), atol=2e-3)
    assert np.dot(vectors[0], vectors[1]) < 0.9999  # different texts, different vectors
    # Floats, token ids and lists of token ids: the same vectors.
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, vectors[0], atol=1e-7)
    by_ids = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, vectors[1], atol=1e-7)
    batch = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in batch.data], vectors, atol=1e-7)
    # The wire format of base64: little-endian float32.
    raw = httpx.post(thread.url + "/v1/embeddings",
                     json={"input": TEXTS[2], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[2], atol=1e-7)


def test_embeddings_leave_the_kv_pool_and_streams_alone(server):
    """An embedding computed while a completion streams: the stream's tokens are those it
    gives alone, and no KV block is taken (conftest checks none is left after the test)."""
    thread, engine, client = server
    alone = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    used_before = engine.kv_manager.num_used_blocks
    stream = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=24, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text, embedded = "", False
    for chunk in stream:
        text += chunk.choices[0].text
        if not embedded:
            client.embeddings.create(model=MODEL, input=TEXTS[1] * 8)
            embedded = True
    assert text == alone
    assert engine.kv_manager.num_used_blocks == used_before


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3-swa"])
def test_offline_embed_chunks_a_long_prompt_as_one_prefill(llm_factory, model):
    """LLM.embed over a prompt longer than a step's token budget (and, for the Gemma 3 shape,
    than its sliding window, whose layers keep their own KV group): chunked forward calls give
    the vectors of one prefill."""
    llm = llm_factory(model=model, max_model_len=MAX_LEN, max_num_batched_tokens=64)
    token_ids = list(range(5, 205))
    (output,) = llm.embed([token_ids])
    assert output.prompt_token_ids == token_ids
    np.testing.assert_allclose(output.embedding, reference_embedding(llm.engine, token_ids), atol=2e-3)
    (raw,) = llm.embed({"prompt_token_ids": token_ids}, normalize=False)
    assert np.linalg.norm(raw.embedding) != pytest.approx(1.0)


@pytest.mark.parametrize("body,param,fragment", [
    pytest.param({"input": ""}, "input", "at least 1", id="empty-text"),
    pytest.param({"input": []}, "input", "", id="empty-list"),
    pytest.param({"input": [[]]}, "input", "", id="empty-token-list"),
    pytest.param({"input": [10**7]}, "input", "vocabulary", id="token-outside-vocab"),
    pytest.param({"input": ["a", "word " * (MAX_LEN + 10)]}, "input", "input[1]", id="too-long"),
    pytest.param({"input": "hi", "dimensions": 3}, "dimensions", "64", id="dimensions"),
    pytest.param({"input": "hi", "encoding_format": "int8"}, "encoding_format", "", id="encoding"),
    pytest.param({"input": "hi", "pooling": "cls"}, "pooling", "Unrecognized", id="unknown-field"),
    pytest.param({"input": "\ud800"}, "input", "string", id="lone-surrogate"),
    pytest.param({"input": ["hi", "\x13"]}, "input", "no tokens", id="no-tokens"),  # (tiny's tokenizer)
])
def test_bad_embedding_requests_get_a_400(server, body, param, fragment):
    thread, engine, client = server
    import json
    resp = httpx.post(thread.url + "/v1/embeddings", content=json.dumps(body),
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert httpx.post(thread.url + "/v1/embeddings", json={"input": "ok"}).status_code == 200


def test_embed_matches_hf_transformers_hidden_states(llm_factory):
    """On the real default model in the parity mode (fp32), chunked by a small step budget: the
    mean of transformers' last hidden states (after its final norm), to fp32 rounding."""
    from hf_reference import hf_model_from_gguf
    from kvserve.loader.resolve import resolve_model

    name = "smollm2-135m-instruct"
    llm = llm_factory(model=name, dtype="float32", quantization="none", max_num_batched_tokens=64)
    token_ids = llm.tokenizer.encode("Quarterly revenue grew five percent, " * 16)
    assert len(token_ids) > 64
    (output,) = llm.embed([token_ids])
    hf = hf_model_from_gguf(resolve_model(name).path)
    with torch.inference_mode():
        hidden = hf(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0]
    mean = hidden.double().mean(dim=0).numpy()
    np.testing.assert_allclose(output.embedding, mean / np.linalg.norm(mean), atol=1e-5)
