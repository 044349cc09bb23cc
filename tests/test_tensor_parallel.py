"""Tensor parallelism: worker processes over gloo against one process, on tiny models shaped
for each case (KV heads split across ranks, or replicated when fewer than ranks); the
executor's failure handling (a worker killed or hung); nothing left running afterwards.

Every engine here is shut down in the test that built it, and every wait is bounded (the
executor's own timeout, plus pytest-timeout as a backstop). Each case starts worker
processes (~10 s on a busy 2-core box), so the default run keeps one case per shape kind;
``--tp-full`` (a pytest option) adds the others and the real models (SmolLM2 at TP=3, Gemma 3 at TP=2:
heavy, run them under the heavy-run lock).
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from typing import Callable, Optional

import psutil
import pytest

from kvserve import SamplingParams
from kvserve.batch import SchedulerOutput
from kvserve.executor.base import ExecutorError
from kvserve.executor.step import StepInput
from kvserve.llm import LLM
from kvserve.structured.params import StructuredOutputsParams

PROMPTS = [[1, 5, 9, 200, 3000, 17, 4242, 99], [1] + list(range(300, 340)), [1, 77, 78, 79]]
LOGPROB_TOLERANCE = 1e-4
FULL = pytest.mark.tp_full  # run with --tp-full (tests/conftest.py)


def _params() -> list[SamplingParams]:
    """Greedy with logprobs and prompt logprobs; seeded sampling (n=2: per-child streams) with
    penalties and min_tokens (the output history the workers keep); a regex-constrained
    request (the grammar's mask computed engine-side, sent with the step)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    seeded = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=7, max_tokens=8, logprobs=5,
                            repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4)
    constrained = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                                 structured_outputs=StructuredOutputsParams(regex="[a-c ]{3,8}"))
    return [greedy, seeded, constrained]


def _max_logprob_gap(a, b) -> float:
    """Largest |difference| over every logprob both outputs report (sampled, top-k, prompt)."""
    worst = 0.0
    pairs = [(x, y) for ca, cb in zip(a.outputs, b.outputs)
             for x, y in zip(ca.logprobs or [], cb.logprobs or [])]
    pairs += [(x, y) for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or []) if x]
    assert pairs
    for x, y in pairs:
        for tok, lp in x.items():
            if tok in y:
                worst = max(worst, abs(lp.logprob - y[tok].logprob))
    return worst


def _children(pid: int) -> list[psutil.Process]:
    """Child processes other than multiprocessing's resource tracker (a spawn-context helper
    that an earlier test, e.g. the bench's isolated peers, may have started for the session)."""
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "multiprocessing.resource_tracker" not in " ".join(_cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # gone already
        return []


def _run_pair(model: str, tp: int, pp: int = 1, check: Optional[Callable] = None,
              params: Optional[list[SamplingParams]] = None, **kwargs) -> None:
    """``check(parallel engine, one-process engine, every StepInput sent)``, when given, runs
    after the comparison, before the workers stop; ``params``: instead of ``_params()`` (the
    third must still be the regex-constrained one)."""
    params = params or _params()
    base = LLM(model=model, dtype="float32", num_blocks=64, **kwargs)
    want = base.generate(PROMPTS, params)
    par = LLM(model=model, dtype="float32", num_blocks=64, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, distributed_timeout_s=60, **kwargs)
    engine = par.engine
    steps = []
    build = engine.step_builder.build

    def record(sched):
        steps.append(build(sched))
        return steps[-1]

    engine.step_builder.build = record
    depths = []
    if pp > 1:
        submit = engine.executor.submit

        def spy(step):  # how many steps were already in flight when this one went out
            depths.append(len(engine._in_flight))
            submit(step)

        engine.executor.submit = spy
    try:
        got = par.generate(PROMPTS, params)
        if pp > 1:
            # The stages overlapped: the next micro-batch went out before the previous came back.
            assert max(depths) == pp - 1, depths
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert _max_logprob_gap(w, g) < LOGPROB_TOLERANCE
        assert re.fullmatch("[a-c ]{3,8}", got[2].outputs[0].text), got[2].outputs[0].text
        # Finished requests are forgotten on every rank (told with the next step), not only
        # in the engine.
        par.engine.executor.execute(par.engine.step_builder.build(SchedulerOutput()))
        assert all(s["num_requests"] == 0 for s in par.engine.executor.worker_stats())
        assert par.engine.kv_manager.num_used_blocks == 0
        if check is not None:
            check(engine, base.engine, steps)
    finally:
        par.engine.shutdown()
    assert not _children(os.getpid())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,tp", [
    ("tiny-llama-h6kv2", 2),   # 3 query heads and 1 KV head per rank
    pytest.param("tiny-llama-h6kv3", 3, marks=FULL),  # 2 query heads and 1 KV head per rank
    ("tiny-llama-h6kv1", 3),   # the one KV head replicated on 3 ranks
    ("tiny-gemma3-h4kv1", 2),  # Gemma 3 270M's shape: 4 / 1 heads, KV head replicated
    ("tiny-qwen3-h4kv2", 2),   # QK-norm (per head: replicated), head_dim 32 != hidden / heads
    ("tiny-phi3-h4kv2", 2),    # fused qkv_proj / gate_up_proj checkpoint tensors cut per part
    ("tiny-qwen3-moe-h4kv2", 2),  # every expert's columns split, the router replicated
    ("tiny-deepseek-v3", 2),  # MLA: 2 of 4 heads per rank, the latent cache replicated; shared experts split
])
def test_tensor_parallel_matches_one_process(model, tp):
    _run_pair(model, tp)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,tp,pp", [
    ("tiny-gemma3", 1, 2),  # 4 layers, 2 per stage (sliding and global ones on each side)
    ("tiny-llama", 2, 2),   # TP x PP = 2 x 2: four workers
])
def test_pipeline_parallel_matches_one_process(model, tp, pp):
    _run_pair(model, tp, pp)


def _check_groups(reclaim: bool):
    """The parallel engine's KV manager has the model's groups (one process's), and each rank
    holds its share of them: with reclaim, sliding groups gave back blocks (the null block in
    tables the workers read), and a rank's cache is no bigger than the sizing said."""

    def check(engine, base, steps) -> None:
        spec = engine.kv_spec
        assert [g.window for g in engine.kv_groups] == base.kv_spec.group_windows == spec.group_windows
        assert [g.layers for g in engine.kv_groups] == [g.layers for g in base.kv_spec.groups]
        assert (spec.num_groups > 1) == reclaim == ("groups:" in engine.describe_kv_cache())
        if reclaim:
            null = engine.kv_manager.block_pool.null_block.block_id
            released = [t for step in steps for c in step.chunks
                        for g, t in enumerate(c.block_tables) if spec.group_windows[g] and null in t]
            assert released, "no sliding-window block was released"
        # Per rank: its KV heads, its stage's layers; the engine sized blocks on the largest.
        per_rank = [s["kv_cache_bytes"] for s in engine.executor.worker_stats()]
        assert max(per_rank) == engine.num_blocks * spec.bytes_per_block == engine.kv_cache_bytes
        # One process's block over the ranks' KV heads, times the slots the largest stage needs.
        tp = engine.args.tensor_parallel_size
        assert spec.bytes_per_block == (base.kv_spec.bytes_per_block // tp * spec.slots_per_group
                                        // base.kv_spec.slots_per_group)

    return check


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,pp,reclaim", [
    (2, 1, True),   # one KV head per rank, every layer in its group and slot
    (1, 2, True),   # stage 1 holds global layer 5 alone, in its slot 0 (the model's slot 1)
    (1, 2, False),  # --no-sliding-window-reclaim: one full group of every layer, as before
])
def test_sliding_window_reclaim_under_parallelism(tp, pp, reclaim):
    """tiny-gemma3-pairs: KV cache groups of two layers (global (2, 5), sliding (0, 1) and
    (3, 4), window 8 < the 41-token prompt): the same outputs as one process, blocks released."""
    _run_pair("tiny-gemma3-pairs", tp, pp, check=_check_groups(reclaim),
              disable_sliding_window_reclaim=not reclaim)


@pytest.mark.timeout(120)
def test_draft_model_with_tensor_parallel_target():
    """The draft model runs in the engine's process, over the full-attention group's blocks;
    the target verifies on 2 ranks (draft_probs sent with the step for sampled requests): the
    same outputs as one process, drafts made and accepted, and the ranks' blocks sized on a
    rank's share (the draft's KV is the engine process's, not theirs)."""
    import json

    spec = json.dumps({"method": "draft_model", "model": "tiny-gemma3-pairs", "quantization": "int4",
                       "num_speculative_tokens": 3, "max_backoff_steps": 0})

    def check(engine, base, steps) -> None:
        drafted = engine.spec_stats()
        assert drafted["spec_draft_tokens"] > 0 and drafted["spec_accepted_tokens"] > 0
        assert any(c.draft_probs is not None for step in steps for c in step.chunks)
        assert engine.speculator.drafter.kv_cache.num_blocks == engine.num_blocks
        per_rank = [s["kv_cache_bytes"] for s in engine.executor.worker_stats()]
        assert per_rank == [engine.kv_cache_bytes] * 2 == [engine.num_blocks * engine.kv_spec.bytes_per_block] * 2
        assert "MiB in the engine's process) in the full-attention group's blocks" in engine.describe_kv_cache()

    greedy, _, constrained = _params()
    # Seeded sampling without penalties: a request the speculator drafts for (see
    # spec.speculator), verified by rejection sampling on the rank that samples.
    seeded = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=7, max_tokens=8, logprobs=5)
    _run_pair("tiny-gemma3-pairs", 2, check=check, params=[greedy, seeded, constrained], speculative_config=spec)


def test_stage_kv_specs_cut_the_model_groups():
    """Each stage keeps every group (its index and window: table g is group g's) with only its
    layers, slots renumbered within the stage; a KVCache of the stage's spec has one LayerKV per
    stage layer, in order, on as many slot tensors as its fullest group needs."""
    from kvserve.distributed import stage_layers
    from kvserve.kv_cache import KVCache, kv_cache_groups
    from kvserve.models.tensor_parallel import rank_kv_spec, stage_kv_spec
    from kvserve.models.testing import tiny_config_by_name

    cfg = tiny_config_by_name("tiny-gemma3-pairs")
    groups = kv_cache_groups(cfg)
    assert [g.layers for g in groups] == [(2, 5), (0, 1), (3, 4)]
    stages = [stage_kv_spec(cfg, 2, stage_layers(6, 2, s), 16, "float32", groups) for s in range(2)]
    assert [[g.layers for g in spec.groups] for spec in stages] == [[(2,), (0, 1), ()], [(5,), (), (3, 4)]]
    assert [spec.group_windows for spec in stages] == [[None, 8, 8]] * 2
    assert [(layer, stages[1].group_of(layer), stages[1].slot_of(layer)) for layer in stages[1].layer_ids] == \
        [(3, 2, 0), (4, 2, 1), (5, 0, 0)]
    assert stages[0].num_kv_heads == 1 and stages[0].slots_per_group == 2
    cache = KVCache.allocate(stages[1], 4, "cpu")
    assert [layer.group for layer in cache] == [2, 2, 0]
    assert cache[0].data is cache[2].data and cache[0].data is not cache[1].data
    assert cache.num_bytes == 4 * stages[1].bytes_per_block
    assert rank_kv_spec(cfg, 2, 2, 16, "float32", groups) == stages[0]
    # Three stages of two layers: stage 1 holds one layer of two groups, one slot per block.
    assert stage_kv_spec(cfg, 1, (2, 4), 16, "float32", groups).slots_per_group == 1
    assert rank_kv_spec(cfg, 1, 3, 16, "float32", groups).slots_per_group == 2  # stage 0's (0, 1)


@pytest.mark.timeout(120)
def test_pipeline_abort_while_its_step_is_in_flight():
    """A request aborted while its micro-batch's step is in the pipeline: its blocks are freed
    at once (a later step may reuse them: every stage runs its steps in order), the late
    result is dropped, every rank forgets it, and the others finish as in one process."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS + [[1, 2, 3, 4, 5, 6]]
    want = LLM(model="tiny-llama", dtype="float32", num_blocks=64).generate(prompts, params)
    par = LLM(model="tiny-llama", dtype="float32", num_blocks=64, pipeline_parallel_size=2,
              distributed_timeout_s=60)
    engine = par.engine
    try:
        ids = [engine.add_request(None, p, params) for p in prompts]
        # Between two calls of step() one micro-batch's step stays in the pipeline.
        while not engine._in_flight:
            engine.step()
        victim = engine._in_flight[0][1].chunks[0].request.request_id
        engine.abort_request(victim)
        assert all(r.request_id != victim for r in engine.scheduler.running)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert finished[victim].outputs[0].finish_reason == "abort"
        for rid, w in zip(ids, want):
            if rid != victim:
                assert finished[rid].outputs[0].token_ids == w.outputs[0].token_ids
        engine.executor.execute(engine.step_builder.build(SchedulerOutput()))
        assert all(s["num_requests"] == 0 for s in engine.executor.worker_stats())
        assert engine.kv_manager.num_used_blocks == 0
    finally:
        engine.shutdown()


@pytest.mark.timeout(300)
@FULL
@pytest.mark.parametrize("model,tp", [("smollm2-135m-instruct", 3), ("gemma-3-270m", 2)])
def test_tensor_parallel_real_models(model, tp):
    _run_pair(model, tp, max_model_len=256)


@pytest.mark.timeout(300)
@FULL
def test_int4_real_model_reuses_q4_1_blocks_per_shard():
    """SmolLM2's Q4_1 blocks are cut on block boundaries for each rank (TP=3: o_proj and
    down_proj inputs of 192 and 512 columns, whole 32-weight blocks) and decode like one
    process does."""
    from kvserve.loader import load_config, resolve_model
    from kvserve.loader.gguf import open_gguf, quantized_weights
    from kvserve.models.tensor_parallel import TPShardPlan

    source = resolve_model("smollm2-135m-instruct")
    config = load_config(source)
    raw = quantized_weights(open_gguf(source.path), config)
    plan = TPShardPlan(config, 1, 3)
    down = plan.shard_raw("model.layers.0.mlp.down_proj.weight", raw["model.layers.0.mlp.down_proj.weight"])
    assert down is not None and down.shape == (576, 512)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 12092, 28, 957, 1462, 314]]
    want = LLM(model="smollm2-135m-instruct", quantization="int4", num_blocks=32).generate(prompts, params)
    par = LLM(model="smollm2-135m-instruct", quantization="int4", num_blocks=32, tensor_parallel_size=3,
              distributed_timeout_s=120)
    try:
        got = par.generate(prompts, params)
    finally:
        par.engine.shutdown()
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w.outputs[0].token_ids, g.outputs[0].token_ids))
    assert agree >= 0.75 * 48


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=FULL), pytest.param("int8", marks=FULL), "int4"])
def test_weight_formats_shard(fmt):
    """Each weight format loads shard by shard and decodes like one process does (greedy; the
    low-precision partial sums may round differently, so most tokens, not all, must agree)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(model="tiny-llama-h6kv2", quantization=fmt, num_blocks=32).generate(PROMPTS, params)
    par = LLM(model="tiny-llama-h6kv2", quantization=fmt, num_blocks=32, tensor_parallel_size=2,
              distributed_timeout_s=60)
    try:
        got = par.generate(PROMPTS, params)
    finally:
        par.engine.shutdown()
    agree = sum(a == b for w, g in zip(want, got)
                for a, b in zip(w.outputs[0].token_ids, g.outputs[0].token_ids))
    assert agree >= 0.75 * sum(len(w.outputs[0].token_ids) for w in want)


@pytest.mark.timeout(90)
# A killed worker is also what test_server_tp's mid-stream test does, through the server.
@pytest.mark.parametrize("fault", [pytest.param("killed", marks=FULL), "hung"])
def test_a_dead_or_hung_worker_stops_the_engine_in_bounded_time(fault):
    llm = LLM(model="tiny-llama-h6kv2", dtype="float32", num_blocks=32, tensor_parallel_size=2,
              distributed_timeout_s=3)
    engine = llm.engine
    victim = psutil.Process(engine.executor.pids[1])
    try:
        engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(victim.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ExecutorError) as info:
            for _ in range(50):
                engine.step()
        assert time.monotonic() - t0 < 15
        if fault == "killed":
            assert "rank 1" in str(info.value)
        else:  # rank 0, waiting for rank 1 in a collective, reports it (before the engine's wait ends)
            assert "rank(s) [1] did not arrive" in str(info.value) or "no answer" in str(info.value)
        # Every worker is gone (the hung one killed), and the engine refuses further steps.
        assert not _children(os.getpid())
        with pytest.raises(ExecutorError):
            engine.executor.execute(StepInput())
    finally:
        if victim.is_running():
            victim.kill()
        engine.abort_request("r")
        engine.shutdown()


@pytest.mark.timeout(30)
def test_shared_memory_collectives(tmp_path):
    """Two ranks (threads here) reduce and gather through one buffer: every rank gets the same
    bits (sum in rank order), repeatedly (the two alternating buffers), and a rank whose peer
    never arrives fails after the timeout instead of spinning."""
    import threading

    import torch

    from kvserve.shm_collectives import ShmCollectives

    path = str(tmp_path / "shm")
    ranks = [ShmCollectives(path, 0, 2, 1 << 16, 5.0, create=True)]
    ranks.append(ShmCollectives(path, 1, 2, 1 << 16, 5.0, create=False))
    inputs = [[torch.randn(3, 7, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(20)]
              for r in range(2)]
    results: list = [None, None]

    def run(r: int) -> None:
        out = []
        for i, x in enumerate(inputs[r]):
            out.append(ranks[r].all_reduce_(x.clone()) if i % 2 else ranks[r].all_gather_last_dim(x))
        results[r] = out

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    # Ranks are processes in use; as threads here, a spinning rank holds the GIL for a whole
    # switch interval each time the other one needs it back (every torch call): at the default
    # 5 ms this test took 2-26 s. A short interval lets the threads alternate as processes do.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    for i in range(20):
        want = (inputs[0][i] + inputs[1][i]) if i % 2 else torch.cat([inputs[0][i], inputs[1][i]], dim=-1)
        assert torch.equal(results[0][i], want) and torch.equal(results[1][i], want)
    lonely = ShmCollectives(str(tmp_path / "lonely"), 0, 2, 1 << 10, 0.2, create=True)
    with pytest.raises(RuntimeError, match="did not arrive"):
        lonely.all_reduce_(torch.ones(4))


def test_q4_1_blocks_shard_like_the_float_weights():
    """Each rank's cut of SmolLM2's Q4_1 blocks (rows for q/k/v, whole 32-weight blocks of
    columns for o/down) dequantizes to exactly its cut of the dequantized weight."""
    import torch

    from kvserve.loader import load_config, resolve_model
    from kvserve.loader.gguf import open_gguf, quantized_weights
    from kvserve.models.tensor_parallel import TPShardPlan
    from kvserve.block_formats import unpack_q4_1

    def dequant(qt):
        b = unpack_q4_1(qt.data, qt.shape)
        return torch.from_numpy((b.q.reshape(b.q.shape[0], -1, 32) * b.d[..., None] + b.m[..., None]).reshape(b.q.shape))

    source = resolve_model("smollm2-135m-instruct")
    config = load_config(source)
    raw = quantized_weights(open_gguf(source.path), config)
    for part in ("mlp.down_proj", "mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.k_proj"):
        name = f"model.layers.3.{part}.weight"
        full = dequant(raw[name])
        for rank in range(3):
            plan = TPShardPlan(config, rank, 3)
            assert torch.equal(dequant(plan.shard_raw(name, raw[name])), plan.shard_weight(name, full)), (name, rank)


def test_fused_checkpoint_tensors_shard_as_their_parts():
    """Phi-3's checkpoint holds q/k/v (and gate/up) in one tensor: each rank's shard is its
    q, k and v shards (gate and up shards) stacked, as the unfused names would give them."""
    import torch

    from kvserve.models.tensor_parallel import TPShardPlan
    from kvserve.models.testing import tiny_config_by_name

    cfg = tiny_config_by_name("tiny-phi3-h4kv2")
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    qkv, gate_up = torch.randn(q + 2 * kv, cfg.hidden_size), torch.randn(2 * inter, cfg.hidden_size)
    for rank in range(2):
        plan = TPShardPlan(cfg, rank, 2)
        layer = "model.layers.0."
        want = torch.cat([plan.shard_weight(layer + "self_attn.q_proj.weight", qkv[:q]),
                          plan.shard_weight(layer + "self_attn.k_proj.weight", qkv[q:q + kv]),
                          plan.shard_weight(layer + "self_attn.v_proj.weight", qkv[q + kv:])])
        assert torch.equal(plan.shard_weight(layer + "self_attn.qkv_proj.weight", qkv), want)
        assert want.shape[0] == (q + 2 * kv) // 2
        want = torch.cat([plan.shard_weight(layer + "mlp.gate_proj.weight", gate_up[:inter]),
                          plan.shard_weight(layer + "mlp.up_proj.weight", gate_up[inter:])])
        assert torch.equal(plan.shard_weight(layer + "mlp.gate_up_proj.weight", gate_up), want)


def test_fused_checkpoint_blocks_shard_as_their_float_values():
    """A phi3 GGUF's fused attn_qkv / ffn_up as Q8_0 blocks: each rank's cut dequantizes to
    its cut of the dequantized tensor."""
    import gguf
    import numpy as np
    import torch

    from kvserve.block_formats import QuantizedTensor
    from kvserve.models.tensor_parallel import TPShardPlan
    from kvserve.models.testing import tiny_config_by_name

    cfg = tiny_config_by_name("tiny-phi3-h4kv2")
    q8 = gguf.GGMLQuantizationType.Q8_0
    rows = {"self_attn.qkv_proj": (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim,
            "mlp.gate_up_proj": 2 * cfg.intermediate_size}
    for part, n in rows.items():
        name = f"model.layers.0.{part}.weight"
        values = np.random.default_rng(0).standard_normal((n, cfg.hidden_size)).astype(np.float32)
        raw = QuantizedTensor(q8, gguf.quants.quantize(values, q8), (n, cfg.hidden_size))
        full = torch.from_numpy(gguf.quants.dequantize(raw.data, q8))
        for rank in range(2):
            plan = TPShardPlan(cfg, rank, 2)
            cut = plan.shard_raw(name, raw)
            assert cut.shape == (n // 2, cfg.hidden_size)
            assert torch.equal(torch.from_numpy(gguf.quants.dequantize(cut.data, q8)), plan.shard_weight(name, full))
