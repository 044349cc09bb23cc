"""The token embedding and the LM head's exact weights held as their Q8_0 blocks
(kvserve.row_table): the same rows, so the same bits everywhere they are read."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from kvserve import loader, ops, row_table
from kvserve.loader import build_model
from kvserve.models.fused import attach_fused_layers
from kvserve.models.testing import build_random_model, tiny_config_by_name, unfused_state_dict
from kvserve.quant import Bf16Linear, Q4Screen, Q8Linear, RescoredLMHead, convert_linear_layers
from kvserve.request import SamplingParams
from kvserve.row_table import Q8Table, keep_embedding_as_blocks, table_args

pytestmark = pytest.mark.skipif(ops.load_extension() is None, reason="needs the fused CPU kernels")


def _q8_exact(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A random fp32 table whose values are Q8_0 blocks' (as a GGUF's dequantized embedding)."""
    torch.manual_seed(seed)
    return Q8Table(*Q8Linear.quantize_reference(torch.randn(*shape))).dequantized()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_q8_table_stands_in_only_for_the_table_it_reproduces_bit_for_bit():
    w = _q8_exact((300, 96), 0)
    table = Q8Table.of_exact(w)
    assert table is not None and table.shape == w.shape
    assert torch.equal(_bits(table.dequantized()), _bits(w))
    ids = torch.tensor([[0, 299], [17, 17]])
    assert torch.equal(_bits(table(ids)), _bits(w[ids]))
    # The head's blocks are taken as they are when they reproduce the table.
    blocks = Q8Linear.quantize_reference(w)
    assert Q8Table.of_exact(w, blocks).qs is blocks[0]

    assert Q8Table.of_exact(torch.randn(300, 96)) is None  # not Q8_0 values
    nudged = w.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(float("inf")))
    assert Q8Table.of_exact(nudged) is None  # one ulp off
    signed = w.clone()
    signed[3, 0] = -0.0  # a zero's sign is part of the bits (the blocks give +0)
    assert Q8Table.of_exact(signed) is None
    assert Q8Table.of_exact(_q8_exact((10, 96), 1)[:, :80].contiguous()) is None  # K not a multiple of 32
    assert Q8Table.of_exact(w.to(torch.bfloat16)) is None


@pytest.mark.parametrize("portable", [False, True])
def test_gathered_rows_dot_reads_the_blocks_as_the_fp32_table(portable):
    ext = ops.load_extension()
    w = _q8_exact((1000, 160), 2)
    table = Q8Table.of_exact(w)
    x = torch.randn(7, 160)
    idx = torch.randint(0, 1000, (7, 64))
    ext.set_portable_dense_kernels(portable)
    try:
        assert torch.equal(_bits(row_table.gathered_rows_dot(x, table, idx)), _bits(row_table.gathered_rows_dot(x, w, idx)))
    finally:
        ext.set_portable_dense_kernels(False)
    assert torch.equal(_bits(row_table.gathered_rows_dot_reference(x, table, idx)),
                       _bits(row_table.gathered_rows_dot_reference(x, w, idx)))
    with pytest.raises(RuntimeError, match="scales"):
        ext.gathered_rows_dot(x, table.qs, idx, table.d[:, :2].contiguous())


def test_rescored_head_on_the_blocks_gives_the_fp32_heads_logits_and_tokens():
    w = _q8_exact((4001, 128), 3)  # a partial last tile of the screen
    screen = Q4Screen.from_float(w)
    on_fp32 = RescoredLMHead(Bf16Linear(w, None), w, screen=screen)
    on_blocks = RescoredLMHead(Bf16Linear(w, None), Q8Table.of_exact(w), screen=screen)
    for rows in (1, 5):
        x = torch.randn(rows, 128)
        assert torch.equal(_bits(on_blocks(x)), _bits(on_fp32(x)))
        assert torch.equal(_bits(on_blocks(x, argmax_only=True)), _bits(on_fp32(x, argmax_only=True)))
        assert torch.equal(on_blocks.argmax_tokens(x), on_fp32.argmax_tokens(x))


def test_keep_embedding_as_blocks_leaves_other_tables_alone():
    w = torch.randn(64, 32)  # not Q8_0 values
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(64, 32, _weight=w)
    model.lm_head = RescoredLMHead(Bf16Linear(w, None), model.model.embed_tokens.weight)
    assert keep_embedding_as_blocks(model) == 0
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert table_args(model.model.embed_tokens) == (model.model.embed_tokens.weight, None)


@pytest.fixture
def q8_exact_embeddings(monkeypatch):
    """Models loaded with token embeddings made of Q8_0 values, as the GGUF models' are."""
    load_float_model = loader._load_float_model

    def load(*args, **kwargs):
        model, config = load_float_model(*args, **kwargs)
        embed = model.model.embed_tokens.weight
        with torch.no_grad():
            embed.copy_(Q8Table(*Q8Linear.quantize_reference(embed)).dequantized())
        return model, config

    monkeypatch.setattr(loader, "_load_float_model", load)


@pytest.mark.parametrize("quantization", ["bf16", "int4"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_an_engine_on_the_blocks_gives_the_same_tokens_and_logprobs(q8_exact_embeddings, monkeypatch, model,
                                                                     quantization):
    """Greedy decoding (the native rounds read the blocks for the lookup and the head's
    rescoring), a prompt's logprobs (the full head, rescored) and sampled tokens: the same as
    an engine that keeps the fp32 table."""
    from kvserve.llm import LLM

    def outputs(llm):
        net = llm.engine.executor.runner.model
        fused, rounds = net.model.fused_layers, []
        decode_round = fused.decode_round
        fused.decode_round = lambda *a, **kw: rounds.append(1) or decode_round(*a, **kw)
        greedy = llm.generate([[5, 9, 200, 31] * 5, [7] * 40], SamplingParams(temperature=0.0, max_tokens=24,
                                                                               ignore_eos=True))
        scored = llm.generate([[11, 12, 13] * 6], SamplingParams(temperature=0.0, max_tokens=4, logprobs=5,
                                                                 prompt_logprobs=3, ignore_eos=True))
        sampled = llm.generate([[3, 4, 5] * 4], SamplingParams(temperature=0.8, seed=7, max_tokens=16,
                                                               ignore_eos=True))
        assert rounds, "no greedy step ran natively"
        return net, ([o.outputs[0].token_ids for o in greedy + sampled],
                     scored[0].outputs[0].logprobs, scored[0].prompt_logprobs)

    args = dict(model=model, dtype="float32", quantization=quantization, kv_cache_memory=16 << 20)
    net, on_blocks = outputs(LLM(**args))
    assert isinstance(net.model.embed_tokens, Q8Table) and net.lm_head.exact_weight is net.model.embed_tokens
    assert net.model.fused_layers is not None
    monkeypatch.setattr("kvserve.quant.convert.keep_embedding_as_blocks", lambda model: 0)
    net, on_fp32 = outputs(LLM(**args))
    assert isinstance(net.model.embed_tokens, nn.Embedding)
    assert on_blocks == on_fp32


@pytest.mark.parametrize("weight_format", ["bf16", "int4"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_an_untied_model_keeps_its_embedding_as_blocks_and_its_heads_fp32_weights(monkeypatch, name, weight_format):
    """Without tied weights only the embedding is the Q8_0 table: the same hidden states and
    logits (full and argmax-only) as with the fp32 table, through the fused layers and the
    Python ones."""
    from test_fused_decoder import _three_steps

    cfg = dataclasses.replace(tiny_config_by_name(name), tie_word_embeddings=False)
    weights = unfused_state_dict(build_random_model(cfg, seed=0))
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = Q8Table(*Q8Linear.quantize_reference(embed)).dequantized()

    def outputs(keep: bool) -> list[torch.Tensor]:
        model = build_model(cfg, ((k, v.clone()) for k, v in weights.items()))
        monkeypatch.setattr("kvserve.quant.convert.keep_embedding_as_blocks", keep_embedding_as_blocks if keep else
                            (lambda model: 0))
        convert_linear_layers(model, weight_format)
        assert isinstance(model.model.embed_tokens, Q8Table if keep else nn.Embedding)
        assert isinstance(model.lm_head.exact_weight, torch.Tensor)
        found, fused = [], attach_fused_layers(model)
        assert fused is not None
        for layers in (fused, None):
            model.model.fused_layers = layers
            hidden = model.model.norm(_three_steps(model, cfg))
            found += [hidden, model.lm_head(hidden), model.lm_head(hidden, argmax_only=True)]
        return found

    for on_blocks, on_fp32 in zip(outputs(True), outputs(False)):
        assert torch.equal(_bits(on_blocks), _bits(on_fp32))
