"""Routed experts (kvserve/models/qwen3_moe.py): the router's top-k with ties to the lower
expert id (natively as in torch), experts that see only their own tokens, a row's result
independent of the batch, and which routing rules the native decoder runs."""
from __future__ import annotations

import pytest
import torch

from kvserve import ops
from kvserve.loader import load_model, resolve_model
from kvserve.models.qwen3_moe import SparseMoEBlock, route
from kvserve.models.routing import softmax_top_k, softmax_top_k_reference
from kvserve.models.testing import build_random_model, tiny_config


def test_router_breaks_ties_by_expert_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(weights, torch.full((2, 2), 0.5))
    weights, _ = route(logits, 2, normalize=False)
    assert torch.allclose(weights[1], torch.full((2,), 0.2))


def _block() -> SparseMoEBlock:
    model = build_random_model(tiny_config("qwen3_moe"), seed=1)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoEBlock)
    return block


def test_experts_run_only_on_their_routed_tokens():
    block = _block()
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    _, experts = route(block.gate(x), block.top_k, block.normalize)
    seen: dict[int, int] = {}
    hooks = [e.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, args[0].shape[0]))
             for i, e in enumerate(block.experts)]
    try:
        out = block(x)
    finally:
        for h in hooks:
            h.remove()
    want = {e: int((experts == e).sum()) for e in range(len(block.experts)) if (experts == e).any()}
    assert seen == want  # one call per active expert, on exactly its rows; idle experts never run
    # The same sum as a dense loop over every expert with the routing weights as a mask.
    weights, experts = route(block.gate(x), block.top_k, block.normalize)
    dense = torch.zeros_like(x)
    for e, expert in enumerate(block.experts):
        w = (weights * (experts == e)).sum(-1, keepdim=True)
        dense += w * expert(x)
    assert (out - dense).abs().max() < 1e-5


def test_a_rows_result_does_not_depend_on_the_batch():
    model, _ = load_model(resolve_model("tiny-qwen3-moe"))  # fp32 kernels as the engine runs them
    block = model.model.layers[0].mlp
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    batched = block(x)
    for i in range(7):
        assert torch.equal(block(x[i:i + 1])[0], batched[i])


def test_native_decoder_runs_softmax_routed_experts_only():
    """Qwen3-MoE's softmax top-k routing runs in the native decoder (tests/test_fused_decoder.py
    holds the two paths together); DeepSeek's routing rules do not (nor does MLA)."""
    from kvserve.models.spec import DecoderLayerSpec

    model, _ = load_model(resolve_model("tiny-qwen3-moe"))
    assert model.layer_spec.mlp == "moe" and model.layer_spec.native
    assert model.model.fused_layers is not None
    assert not DecoderLayerSpec(mlp="moe").native and not DecoderLayerSpec(mlp="moe", routing="noaux_tc").native


@pytest.mark.skipif(ops.load_extension() is None, reason="fused kernels disabled")
@pytest.mark.parametrize("normalize", [True, False])
def test_native_routing_follows_the_torch_rule(normalize):
    """csrc/moe_routing.cpp (what both paths route with) against routing.py's torch rule: the
    same experts in the same order, the weights to fp32 rounding, ties to the lower index."""
    logits = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 3
    logits[5, 17] = logits[5, 90] = logits[5].max() + 1  # a tie for the first place
    weights, experts = softmax_top_k(logits, 8, normalize)
    want_weights, want_experts = softmax_top_k_reference(logits, 8, normalize)
    assert torch.equal(experts, want_experts)
    assert experts[5, :2].tolist() == [17, 90] and weights[5, 0] == weights[5, 1]
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(64))
    with pytest.raises(RuntimeError, match="1 <= k <= 128"):
        softmax_top_k(logits, 129, normalize)


def test_tensor_parallel_checks_the_experts_width():
    import pytest

    from kvserve.config import ConfigError
    from kvserve.models.tensor_parallel import check_tp_shape, local_config

    cfg = tiny_config("qwen3_moe")  # experts 32 wide
    assert local_config(cfg, 2).moe_intermediate_size == 16
    cfg.intermediate_size = 192
    with pytest.raises(ConfigError, match="experts' intermediate size 32"):
        check_tp_shape(cfg, 3)


def test_flop_count_takes_the_routed_experts_only():
    from kvserve.bench.machine import ModelFlops

    cfg = tiny_config("qwen3_moe")  # 3 layers, layer 1 dense; 8 experts of width 32, top 2
    h = cfg.hidden_size
    attn = 2 * h * cfg.num_attention_heads * cfg.head_dim + 2 * h * cfg.num_key_value_heads * cfg.head_dim
    moe = h * 8 + 3 * h * 32 * 2
    assert ModelFlops.from_config(cfg).non_embedding_params == 3 * attn + 2 * moe + 3 * h * cfg.intermediate_size


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_and_logprobs_bitwise_alone_or_in_a_batch(quantization):
    """Issue 15's guarantee on routed experts: a request's tokens and logprobs do not change
    with what runs beside it. int4 with bf16 prefill copies: an expert's rows keep their
    token roles (prompt rows through the copy, generated ones through the blocks), so the
    mixed steps of a batch read each row's own format."""
    import random

    from kvserve import SamplingParams
    from kvserve.llm import LLM

    kwargs = {"int4_prefill": "bf16"} if quantization == "int4" else {}
    # A small token budget: prompt chunks share steps with decodes (steps of mixed roles).
    llm = LLM(model="tiny-qwen3-moe", dtype="float32", quantization=quantization, kv_cache_memory=8 << 20,
              max_num_batched_tokens=32, **kwargs)
    rng = random.Random(3)
    target = [rng.randrange(100, 40000) for _ in range(70)]
    others = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)

    def signature(out):
        c = out.outputs[0]
        return c.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs]

    alone = signature(llm.generate([target], params)[0])
    llm.engine.kv_manager.reset_prefix_cache()
    crowd = llm.generate(others[:4] + [target] + others[4:], params)
    assert signature(crowd[4]) == alone
