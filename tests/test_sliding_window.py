"""Sliding-window KV groups end to end (issue #12): a Gemma-shaped model keeps only the blocks
its local layers can still see, outputs do not change with or without reclaim, and sizing,
admission and the start-up line count the groups. Mistral (issue 62: one window on every layer,
no full group) reclaims the same way, on the native and the torch paths.
"""
from __future__ import annotations

import math
import random

import pytest

from kvserve import SamplingParams
from kvserve.config import ModelConfig
from kvserve.kv_cache import KVCacheSpec
from kvserve.kv_manager import max_blocks_per_request
from kvserve.request import RequestRejected

SWA = "tiny-gemma3-swa"  # 5 sliding (window 32) : 1 full layer, like Gemma 3
MISTRAL = "tiny-mistral-swa"  # 2 layers, both sliding (window 24): one sliding group


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for length in lengths[:n]]


def _tokens(llm, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_layout_of_a_gemma_shaped_model(llm_factory):
    llm = llm_factory(model=SWA, dtype="float32")
    spec = llm.engine.kv_spec
    assert spec.group_windows == [None] + [32] * 5 and spec.slots_per_group == 1
    assert [g.layers for g in spec.groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    # One slot tensor serves all six groups: a block id is one layer's block.
    assert len({id(layer.data) for layer in llm.engine.executor.runner.kv_cache}) == 1
    assert llm.engine.kv_cache_bytes == llm.engine.num_blocks * spec.bytes_per_block
    line = llm.engine.describe_kv_cache()
    per_token = spec.bytes_per_group_token
    assert f"1 x full at {per_token} bytes per token each, 5 x window 32 at {per_token} bytes per token each" in line
    assert f"a 8192-token request holds at most {llm.engine.max_request_blocks} blocks" in line
    # LLaMA: one full group, one tensor per layer, no null block: today's layout.
    llama = llm_factory(model="tiny-llama")
    assert llama.engine.kv_spec.num_groups == 1 and llama.engine.kv_manager.block_pool.null_block is None
    assert len({id(layer.data) for layer in llama.engine.executor.runner.kv_cache}) == 2
    assert "groups" not in llama.engine.describe_kv_cache()


def test_decode_holds_a_window_and_frees_everything(llm_factory):
    """The engine (runner, kernels, scheduler) over 600 decode steps, 18 window lengths; the
    4,000-step bookkeeping run is tests/test_kv_groups.py's."""
    llm = llm_factory(model=SWA, dtype="float32", num_blocks=1000)
    engine, kv = llm.engine, llm.engine.kv_manager
    bound = math.ceil(32 / 16) + 1
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    prompt = _prompts(1, [70])[0]
    rid = engine.add_request(None, prompt, params)
    other = engine.add_request(None, prompt[:48] + [7, 8, 9], SamplingParams(max_tokens=300, ignore_eos=True))
    steps = peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        request = engine.scheduler.get_request(rid)
        if request is not None and request.num_computed_tokens > len(prompt):  # decoding
            held = [kv.num_held_blocks(rid, g) for g in range(1, 6)]
            peak = max(peak, *held)
            assert max(held) <= bound, (steps, held)
            assert kv.num_held_blocks(rid, 0) == kv.num_blocks_for(request.num_computed_tokens)
        if steps == 150:
            engine.abort_request(other)  # an abort frees every group's blocks too
            assert kv.num_used_blocks == sum(kv.num_held_blocks(rid, g) for g in range(6))
    assert steps >= 600 and peak == bound
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks == 999


@pytest.mark.parametrize("model", [SWA, MISTRAL])
def test_greedy_identical_with_and_without_reclaim(llm_factory, model):
    """Prompts over two windows, generation across window and block boundaries, in a batch,
    chunked (chunks longer than the window), from the prefix cache and preempted."""
    prompts = _prompts(3, [100, 150, 37], seed=4)
    max_tokens = 60
    reference = llm_factory(model=model, dtype="float32", disable_sliding_window_reclaim=True)
    assert reference.engine.kv_spec.num_groups == 1 and not reference.engine.kv_spec.has_sliding_groups
    alone = [_tokens(reference, [p], max_tokens)[0] for p in prompts]
    llm = llm_factory(model=model, dtype="float32")
    assert llm.engine.kv_spec.has_sliding_groups
    assert [_tokens(llm, [p], max_tokens)[0] for p in prompts] == alone
    assert _tokens(llm, prompts, max_tokens) == alone
    hits = llm.engine.kv_manager.prefix_cache_hits
    assert _tokens(llm, prompts, max_tokens) == alone  # from the prefix cache
    assert llm.engine.kv_manager.prefix_cache_hits - hits >= 96 + 144 + 32
    for budget in (5, 48):
        chunked = llm_factory(model=model, dtype="float32", max_num_batched_tokens=budget,
                              enable_prefix_caching=False)
        assert _tokens(chunked, prompts, max_tokens) == alone, budget
    # Room for the longest request alone (chunked: its sliding groups hold a window and a
    # chunk), so the others push it or each other out and recompute.
    windows = llm.engine.kv_spec.group_windows
    room = max(max_blocks_per_request(len(p) + max_tokens - 1, 16, windows, 48) for p in prompts) + 1
    small = llm_factory(model=model, dtype="float32", num_blocks=room, enable_prefix_caching=False,
                        max_num_batched_tokens=48)
    assert _tokens(small, prompts, max_tokens) == alone
    assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("model", [SWA, MISTRAL])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_reclaim_with_other_kv_dtypes(llm_factory, kv_cache_dtype, model):
    prompts = _prompts(2, [90, 130], seed=5)
    reference = llm_factory(model=model, dtype="float32", kv_cache_dtype=kv_cache_dtype,
                            disable_sliding_window_reclaim=True)
    llm = llm_factory(model=model, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    assert _tokens(llm, prompts, 40) == _tokens(reference, prompts, 40)


def test_request_too_large_counts_each_group(llm_factory):
    # 208 tokens of KV: 13 blocks in the full group and, while the whole prompt is one chunk,
    # min(13, ceil((31 + 208) / 16) + 1) = 13 in each sliding group.
    need = max_blocks_per_request(208, 16, [None] + [32] * 5, 2048)
    assert need == 13 * 6
    llm = llm_factory(model=SWA, dtype="float32", num_blocks=need + 1)
    prompt = _prompts(1, [190])[0]
    assert len(_tokens(llm, [prompt], 19)[0]) == 19
    with pytest.raises(RequestRejected, match="84 blocks of 16 over 6 KV cache groups"):
        llm.generate([prompt], SamplingParams(max_tokens=20))
    # A smaller chunk budget lowers the sliding groups' peak (ceil((31 + 16) / 16) + 1 = 4
    # blocks): a request 3x as long fits the same cache.
    chunked = llm_factory(model=SWA, dtype="float32", num_blocks=need + 1, max_num_batched_tokens=16)
    assert len(_tokens(chunked, [_prompts(1, [500])[0]], 10)[0]) == 10


def _gemma_270m(reclaim: bool) -> KVCacheSpec:
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    config = ModelConfig(architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                         num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         max_position_embeddings=32768, sliding_window=512, layer_types=layer_types)
    return KVCacheSpec.for_model(config, 16, "bfloat16", reclaim_sliding_window=reclaim)


def test_capacity_of_8192_token_gemma_requests_at_1_gib():
    """The same --kv-cache-memory holds at least 4x the 8,192-token Gemma-3-270M requests:
    3 global layers x 8,192 tokens + 15 local layers x 528 tokens instead of 18 x 8,192."""
    budget = 1 << 30

    def requests_at_once(spec: KVCacheSpec) -> int:
        usable = budget // spec.bytes_per_block - int(spec.has_sliding_groups)
        return usable // max_blocks_per_request(8192, 16, spec.group_windows, 1)

    before, after = _gemma_270m(False), _gemma_270m(True)
    assert before.num_groups == 1 and after.group_windows == [None] + [512] * 5
    assert after.slots_per_group == 3 and after.bytes_per_block * 6 == before.bytes_per_block
    assert requests_at_once(before) == 7 and requests_at_once(after) == 32
    assert requests_at_once(after) >= 4 * requests_at_once(before)


# ---- Mistral (issue 62): every layer slides, one window; no full group


def test_layout_of_a_mistral_model(llm_factory):
    llm = llm_factory(model=MISTRAL, dtype="float32")
    engine, spec = llm.engine, llm.engine.kv_spec
    assert [(g.layers, g.window) for g in spec.groups] == [((0, 1), 24)] and spec.slots_per_group == 2
    assert engine.kv_manager.block_pool.null_block is not None  # released entries point at it
    assert spec.bytes_per_group_token == spec.bytes_per_token  # one group: a block is every layer's
    need = max_blocks_per_request(engine.max_model_len, 16, [24], engine.args.max_num_batched_tokens)
    assert engine.max_request_blocks == need < -(-engine.max_model_len // 16)
    line = engine.describe_kv_cache()
    assert f"{engine.num_blocks} blocks x 16 tokens = {engine.kv_cache_tokens} tokens, " in line
    assert f"groups: 1 x window 24 at {spec.bytes_per_token} bytes per token each" in line
    assert (f"a {engine.max_model_len}-token request holds at most {need} blocks = "
            f"{need * spec.bytes_per_block / 2**20:.1f} MiB, the cost of {need * 16} tokens in every layer "
            f"({engine.max_model_len * spec.bytes_per_token / 2**20:.1f} MiB without reclaim)") in line
    off = llm_factory(model=MISTRAL, dtype="float32", disable_sliding_window_reclaim=True)
    assert off.engine.kv_spec.group_windows == [None] and off.engine.kv_manager.block_pool.null_block is None
    assert "groups" not in off.engine.describe_kv_cache()


def test_mistral_request_longer_than_the_pool(llm_factory):
    """A 700-token request in 39 usable blocks (624 tokens), prefilled in chunks of 32 beside
    a shorter one that is aborted: it holds its window and one chunk, gives the same tokens as
    the whole context would, and every block comes back."""
    C, W = 32, 24
    llm = llm_factory(model=MISTRAL, dtype="float32", num_blocks=40, max_num_batched_tokens=C)
    engine, kv = llm.engine, llm.engine.kv_manager
    prompt = _prompts(1, [400], seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    rid = engine.add_request(None, prompt, params)
    other = engine.add_request(None, prompt[:40] + [7, 8], params)
    steps, outputs = 0, {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        steps += 1
        request = engine.scheduler.get_request(rid)
        if request is not None:
            decoding = request.num_computed_tokens > len(prompt)
            bound = math.ceil(W / 16) + 1 if decoding else math.ceil((W - 1 + C) / 16) + 1
            assert kv.num_held_blocks(rid, 0) <= bound, (steps, request.num_computed_tokens)
        if steps == 100:
            engine.abort_request(other)
    assert len(prompt) + len(outputs[rid]) > kv.num_usable_blocks * 16
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks == 39
    reference = llm_factory(model=MISTRAL, dtype="float32", disable_sliding_window_reclaim=True)
    assert outputs[rid] == _tokens(reference, [prompt], 300)[0]


def _hf_mistral_greedy(prompt: list[int], steps: int) -> list[int]:
    """HF transformers' Mistral with the engine's tiny weights (kvserve.loader builds
    tiny models with seed 0), greedy, each step a forward over the whole sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvserve.models.testing import build_random_model, tiny_config, to_hf_config, unfused_state_dict

    config = tiny_config("mistral-swa")
    hf = AutoModelForCausalLM.from_config(to_hf_config(config), dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(unfused_state_dict(build_random_model(config, seed=0)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8"])
def test_mistral_reclaim_on_both_paths(llm_factory, native, kv_cache_dtype):
    """The fused native decoder and the layer-by-layer torch path read the one sliding group
    through group 0's tables: the same tokens as without reclaim, in a batch and from the prefix
    cache; in fp32, HF transformers' tokens (a 100-token prompt, four windows)."""
    from kvserve import ops
    from kvserve.config import KernelConfig

    if native and ops.load_extension() is None:
        pytest.skip("fused kernels unavailable")
    kernels = KernelConfig(native_kernels=native)
    prompts = _prompts(2, [100, 61], seed=9)
    reference = llm_factory(model=MISTRAL, dtype="float32", kv_cache_dtype=kv_cache_dtype, kernel_config=kernels,
                            disable_sliding_window_reclaim=True)
    llm = llm_factory(model=MISTRAL, dtype="float32", kv_cache_dtype=kv_cache_dtype, kernel_config=kernels)
    assert llm.engine.kernel_config.native_kernels is native
    if native:
        assert llm.engine.model.model.fused_layers is not None
    expected = [_tokens(reference, [p], 30)[0] for p in prompts]
    assert _tokens(llm, prompts, 30) == expected
    hits = llm.engine.kv_manager.prefix_cache_hits
    assert _tokens(llm, prompts, 30) == expected
    assert llm.engine.kv_manager.prefix_cache_hits - hits == 96 + 48
    if kv_cache_dtype == "auto":
        assert expected[0] == _hf_mistral_greedy(prompts[0], 30)


def test_a_draft_model_keeps_mistral_in_one_full_group(llm_factory):
    """The draft model's KV lives in group 0's blocks at every position: with no full group,
    the target keeps its whole context (and the same tokens)."""
    import json

    spec = json.dumps({"method": "draft_model", "model": MISTRAL, "num_speculative_tokens": 3,
                       "max_backoff_steps": 0})
    llm = llm_factory(model=MISTRAL, dtype="float32", speculative_config=spec)
    assert llm.engine.kv_spec.group_windows == [None]
    prompts = _prompts(2, [70, 33], seed=3)
    assert _tokens(llm, prompts, 20) == _tokens(llm_factory(model=MISTRAL, dtype="float32"), prompts, 20)


def _mistral_7b(reclaim: bool, kv_dtype: str = "bfloat16") -> KVCacheSpec:
    config = ModelConfig(architecture="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=32768, sliding_window=4096,
                         layer_types=["sliding_attention"] * 32)
    return KVCacheSpec.for_model(config, 16, kv_dtype, reclaim_sliding_window=reclaim)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_capacity_of_32k_token_mistral_7b_requests(kv_dtype):
    """Mistral-7B's shape (32 layers, 8 KV heads x 128, window 4,096), 32,768-token requests,
    a 16 GiB KV budget, default chunk of 2,048: how many fit at once (admission counts each
    request's peak: its window and one prefill chunk) and how many their steady decode needs."""
    budget, n, chunk = 16 << 30, 32768, 2048
    before, after = _mistral_7b(False, kv_dtype), _mistral_7b(True, kv_dtype)
    assert before.group_windows == [None] and after.group_windows == [4096]
    assert after.bytes_per_block == before.bytes_per_block  # one group of every layer either way
    figures = {}
    for name, spec in (("without reclaim", before), ("with reclaim", after)):
        usable = budget // spec.bytes_per_block - int(spec.has_sliding_groups)
        admitted = usable // max_blocks_per_request(n, 16, spec.group_windows, chunk)
        decoding = usable // max_blocks_per_request(n, 16, spec.group_windows, 1)
        figures[name] = admitted, decoding
        print(f"\nMistral-7B shape, {kv_dtype} KV ({spec.bytes_per_token} bytes per token), 16 GiB, {name}: "
              f"{usable * 16:,} tokens of pool; {admitted} requests of {n:,} tokens at once while prefilling "
              f"({admitted * n:,} tokens of context), {decoding} decoding ({decoding * n:,})")
    (before_admitted, before_decoding), (after_admitted, after_decoding) = figures.values()
    assert before_admitted == before_decoding == budget // (n * before.bytes_per_token)
    assert after_admitted >= 5 * before_admitted and after_decoding >= 7 * before_decoding


def test_gemma_3_270m_greedy_identical_with_and_without_reclaim():
    """The real model in fp32: prompts over two 512-token windows, generation crossing a
    window boundary (positions 1024 and 1536), batched, then from the prefix cache. One fp32
    Gemma in memory at a time (not the session's engine cache: 1 GB of weights each)."""
    import gc

    from kvserve.llm import LLM

    base = dict(model="gemma-3-270m", dtype="float32", quantization="none", kv_cache_memory=256 << 20)
    prompts = _prompts(2, [1010, 1530], seed=12)
    reference = LLM(**base, disable_sliding_window_reclaim=True)
    expected = _tokens(reference, prompts, 40)
    del reference
    gc.collect()
    llm = LLM(**base)
    assert llm.engine.kv_spec.group_windows == [None] + [512] * 5
    assert _tokens(llm, prompts, 40) == expected
    hits = llm.engine.kv_manager.prefix_cache_hits
    assert _tokens(llm, prompts, 40) == expected
    assert llm.engine.kv_manager.prefix_cache_hits - hits == 1008 + 1520
    assert llm.engine.kv_manager.num_used_blocks == 0
