"""kvserve's paged models vs HF transformers on the same GGUF files (fp32).

For each real model, three prompts of different lengths (Gemma's longest, 600 tokens,
exceeds its 512-token sliding window) run as ONE batch through the paged forward with a
shuffled, non-contiguous block table (block_size 16): prefill, then 32 greedy decode steps.
The reference is HF's own incremental greedy loop (its KV cache, its sliding-window
cache). Also: tiny random models vs HF (window 8 really slides), an HF safetensors
directory round trip, and chunked prefill equal to one-shot prefill.
"""
from __future__ import annotations

import inspect
import json
import os
import random
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_reference import hf_model_from_gguf  # noqa: E402
from kvserve.attention import build_attention_metadata
from kvserve.kv_cache import allocate_kv_cache  # noqa: E402
from kvserve.loader import load_model, resolve_model  # noqa: E402
from kvserve.loader.resolve import ModelSource  # noqa: E402
from kvserve.models.testing import (  # noqa: E402
    build_random_model, tiny_config, to_hf_config, unfused_state_dict,
)

BLOCK_SIZE = 16
NUM_DECODE = 32  # greedy continuation checked token for token (HF: on the longest prompt)
NUM_DECODE_LOGITS_CHECKED = 8  # decode steps whose logits are compared, for all three sequences
LOGITS_ATOL = 1e-3
# A sequence's logits alone vs inside a batch, fp32: bit for bit (issue #15). MKL's sgemm, used
# before, summed in another order for M=1, 2..3, >=4 and large M, which Gemma 3's 18 layers
# amplified to 1.0-1.2e-4; kvserve's own fp32 kernel reduces every output in one fixed order.
PROMPTS = json.loads((Path(__file__).parent / "data" / "parity_prompts.json").read_text())


class PagedRunner:
    """Drives a kvserve model over fixed sequences the way the engine does: one flattened
    batch per step, each sequence on its own shuffled blocks."""

    def __init__(self, model, config, max_lens: list[int], seed: int = 0) -> None:
        self.model = model
        need = [-(-n // BLOCK_SIZE) for n in max_lens]
        ids = list(range(sum(need) + 3))
        random.Random(seed).shuffle(ids)
        self.tables = []
        for n in need:
            self.tables.append(ids[:n])
            ids = ids[n:]
        self.kv_caches = allocate_kv_cache(config, sum(need) + 3, BLOCK_SIZE, torch.float32, "cpu")
        self.lens = [0] * len(max_lens)

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Append ``new_tokens[s]`` to every sequence; logits at each one's last new token."""
        q_lens = [len(t) for t in new_tokens]
        md = build_attention_metadata(self.tables, self.lens, q_lens, BLOCK_SIZE)
        input_ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64)
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(self.lens, q_lens)])
        logits_indices = torch.tensor(md.query_start_loc[1:], dtype=torch.int64) - 1
        logits = self.model(input_ids, positions, md, self.kv_caches, logits_indices)
        self.lens = [c + q for c, q in zip(self.lens, q_lens)]
        return logits

    def greedy(self, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Prefill all prompts in one step, then ``steps`` batched decode steps."""
        logits = self.step(prompts)
        all_logits, tokens = [logits], [[] for _ in prompts]
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            for s, t in enumerate(nxt):
                tokens[s].append(t)
            logits = self.step([[t] for t in nxt])
            all_logits.append(logits)
        return all_logits, tokens


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """HF's incremental greedy loop: logits after the prompt and after each fed token."""
    # transformers 5.x renames the cache argument ``past_key_values`` -> ``cache``.
    cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    out = hf_model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    logits, tokens = [out.logits[0, -1].float()], []
    for _ in range(steps):
        tok = int(logits[-1].argmax())
        tokens.append(tok)
        out = hf_model(torch.tensor([[tok]]), use_cache=True, **{cache_arg: out.past_key_values})
        logits.append(out.logits[0, -1].float())
    return logits, tokens


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma-3-270m"])
def real_model_run(request):
    name = request.param
    prompts = PROMPTS[name]
    source = resolve_model(name)
    t0 = time.perf_counter()
    model, config = load_model(source, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    print(f"\n{name}: kvserve load {load_s:.2f} s")

    runner = PagedRunner(model, config, [len(p) + NUM_DECODE + 1 for p in prompts])
    ours_logits, ours_tokens = runner.greedy(prompts, NUM_DECODE)
    # The middle sequence again, alone in the batch (and on other blocks).
    alone = PagedRunner(model, config, [len(prompts[1]) + 8], seed=1)
    alone_logits = [alone.step([prompts[1]])[0]]
    for t in ours_tokens[1][:4]:
        alone_logits.append(alone.step([[t]])[0])

    hf = hf_model_from_gguf(source.path)  # transformers' own GGUF loader (tests/hf_reference.py)
    # HF's full 32-step loop on the longest prompt (Gemma: decoding past its 512 window), the
    # steps whose logits are compared on the others.
    hf_runs = [hf_greedy(hf, p, NUM_DECODE if s == 0 else NUM_DECODE_LOGITS_CHECKED) for s, p in enumerate(prompts)]
    del hf
    return dict(name=name, config=config, prompts=prompts, ours_logits=ours_logits, ours_tokens=ours_tokens,
                alone_logits=alone_logits, hf_runs=hf_runs)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_config_matches_hf_expectations(real_model_run):
    cfg = real_model_run["config"]
    if real_model_run["name"] == "gemma-3-270m":
        assert max(len(p) for p in real_model_run["prompts"]) > cfg.sliding_window
        assert cfg.layer_types.count("full_attention") == 3


def test_prefill_logits_match_hf(real_model_run):
    run = real_model_run
    diffs = [_max_diff(run["ours_logits"][0][s], run["hf_runs"][s][0][0]) for s in range(3)]
    print(f"\n{run['name']} prefill max|diff| per sequence: {[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) < LOGITS_ATOL


def test_decode_logits_match_hf(real_model_run):
    run = real_model_run
    worst = 0.0
    for s in range(3):
        hf_logits, hf_tokens = run["hf_runs"][s]
        # Both fed the same greedy tokens so far (checked below over all 32 steps).
        assert run["ours_tokens"][s][:NUM_DECODE_LOGITS_CHECKED] == hf_tokens[:NUM_DECODE_LOGITS_CHECKED]
        for step in range(1, NUM_DECODE_LOGITS_CHECKED + 1):
            worst = max(worst, _max_diff(run["ours_logits"][step][s], hf_logits[step]))
    print(f"\n{run['name']} decode ({NUM_DECODE_LOGITS_CHECKED} steps) max|diff|: {worst:.2e}")
    assert worst < LOGITS_ATOL


def test_greedy_continuation_matches_hf(real_model_run):
    run = real_model_run
    hf_tokens = run["hf_runs"][0][1]
    assert len(hf_tokens) == NUM_DECODE
    assert run["ours_tokens"][0] == hf_tokens, "greedy continuation diverged from HF"


def test_batch_invariance(real_model_run):
    run = real_model_run
    worst = max(_max_diff(alone, run["ours_logits"][i][1]) for i, alone in enumerate(run["alone_logits"]))
    print(f"\n{run['name']} alone vs batched max|diff|: {worst:.2e}")
    for i, alone in enumerate(run["alone_logits"]):
        assert torch.equal(alone, run["ours_logits"][i][1]), f"step {i}"


# ------------------------------------------------------------------ tiny models vs HF


def _hf_reference(model, config):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(to_hf_config(config), dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(unfused_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3", "phi3", "mistral-swa"])
def test_tiny_models_match_hf(arch):
    config = tiny_config(arch)
    model = build_random_model(config, seed=3)
    hf = _hf_reference(model, config)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (30, 5, 17)]
    runner = PagedRunner(model, config, [len(p) + 13 for p in prompts])
    ours_logits, ours_tokens = runner.greedy(prompts, 12)
    for s, prompt in enumerate(prompts):
        hf_logits, hf_tokens = hf_greedy(hf, prompt, 12)
        assert ours_tokens[s] == hf_tokens
        for step in range(13):
            assert _max_diff(ours_logits[step][s], hf_logits[step]) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3", "phi3", "mistral-swa"])
def test_chunked_prefill_equals_one_shot(arch):
    config = tiny_config(arch)
    model = build_random_model(config, seed=4)
    prompt = torch.randint(3, config.vocab_size, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    one_shot = PagedRunner(model, config, [48]).step([prompt])
    chunked = PagedRunner(model, config, [48], seed=2)
    for a, b in [(0, 7), (7, 23), (23, 24), (24, 45)]:  # uneven chunks, one of a single token
        logits = chunked.step([prompt[a:b]])
    assert _max_diff(logits, one_shot) < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "gemma3_text"])
def test_hf_safetensors_dir_matches_hf(tmp_path, model_type):
    """An HF directory written by transformers itself (random tiny weights) loads and agrees."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if model_type == "llama":
        hf_config = LlamaConfig(tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, **common)
    elif model_type == "mistral":
        hf_config = MistralConfig(sliding_window=6, **common)  # every layer windowed
    elif model_type == "qwen2":
        hf_config = Qwen2Config(tie_word_embeddings=True, **common)
    else:
        hf_config = Gemma3TextConfig(sliding_window=6, layer_types=["sliding_attention", "full_attention",
                                                                    "sliding_attention"], **common)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises norms to 0/1 and biases to 0: perturb so they matter
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model, config = load_model(ModelSource(kind="hf_dir", path=str(tmp_path), name="tmp"))
    assert config.architecture == {"gemma3_text": "gemma3"}.get(model_type, model_type)
    prompt = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    ours_logits, ours_tokens = PagedRunner(model, config, [30]).greedy([prompt], 6)
    hf_logits, hf_tokens = hf_greedy(hf, prompt, 6)
    assert ours_tokens[0] == hf_tokens
    for step in range(7):
        assert _max_diff(ours_logits[step][0], hf_logits[step]) < 1e-4


# ------------------------------------------------------------------ issue 62's architectures


def _hf_tiny(model_type: str):
    """A random tiny HF model of ``model_type`` (fp32, eval), its norms and biases perturbed so
    that they matter. ``phi3-longrope``: Phi-3 with LongRoPE factors and an original context
    of 32 tokens, so that decoding crosses from the short factors to the long ones;
    ``mistral``: a 6-token window, shorter than the 20-token prompt."""
    from transformers import AutoModelForCausalLM, MistralConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if model_type == "qwen3":
        hf_config = Qwen3Config(head_dim=32, tie_word_embeddings=True, **common)  # head_dim != hidden / heads
    elif model_type == "qwen3_moe":  # 8 experts, top 3 renormalised; layer 1 dense
        hf_config = Qwen3MoeConfig(head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                   norm_topk_prob=True, mlp_only_layers=[1], **common)
    elif model_type == "qwen3_moe-unnormalized":  # top 2 of 4, weights as the softmax gives them
        hf_config = Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=False, **common)
    elif model_type == "phi3":
        hf_config = Phi3Config(pad_token_id=None, **common)
    elif model_type == "phi3-longrope":
        gen = torch.Generator().manual_seed(9)
        short, long = (1.0 + 3.0 * torch.rand(8, generator=gen)).tolist(), (1.0 + 30.0 * torch.rand(8, generator=gen)).tolist()
        hf_config = Phi3Config(pad_token_id=None, original_max_position_embeddings=32, rope_scaling={
            "rope_type": "longrope", "short_factor": short, "long_factor": long}, **common)
    else:
        hf_config = MistralConfig(sliding_window=6, head_dim=16, **common)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("model_type", ["qwen3", "phi3", "phi3-longrope", "mistral", "qwen3_moe",
                                        "qwen3_moe-unnormalized"])
def test_new_architectures_from_safetensors_match_hf_on_both_paths(tmp_path, model_type):
    """Issue 62: an HF directory written by transformers' save_pretrained (random tiny
    weights) loads; the native fused decoder and the layer-by-layer torch path give the same
    bits; both give HF's greedy tokens, logits within 1e-3 (qwen3_moe: the routed experts in the
    native decoder too)."""
    from kvserve import ops

    hf = _hf_tiny(model_type)
    hf.save_pretrained(tmp_path)
    model, config = load_model(ModelSource(kind="hf_dir", path=str(tmp_path), name="tmp"))
    assert config.architecture == model_type.split("-")[0]
    if model_type == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.mlp_only_layers) == (8, 3, [1])
    if model_type == "mistral":
        assert config.sliding_window == 6 and config.layer_types == ["sliding_attention"] * 3
    if model_type == "phi3-longrope":
        assert config.rope_scaling["rope_type"] == "longrope"
    prompt = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    steps = 24  # (phi3-longrope: positions 20..43, across its original context of 32)
    fused = model.model.fused_layers
    assert (fused is not None) == (ops.load_extension() is not None)
    native_logits, native_tokens = PagedRunner(model, config, [48]).greedy([prompt], steps)
    model.model.fused_layers = None
    try:
        torch_logits, torch_tokens = PagedRunner(model, config, [48], seed=3).greedy([prompt], steps)
    finally:
        model.model.fused_layers = fused
    assert native_tokens == torch_tokens
    for a, b in zip(native_logits, torch_logits):
        assert torch.equal(a, b)
    hf_logits, hf_tokens = hf_greedy(hf, prompt, steps)
    assert native_tokens[0] == hf_tokens
    worst = max(_max_diff(native_logits[step][0], hf_logits[step]) for step in range(steps + 1))
    print(f"\n{model_type}: max|diff| vs HF {worst:.2e}")
    assert worst < LOGITS_ATOL
