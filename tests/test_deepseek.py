"""DeepSeek V2/V3 (issue 62): multi-head latent attention on the latent KV cache and MoE with
grouped routing, against HF transformers' own DeepseekV2/V3 modelling (random tiny weights,
fp32): greedy tokens identical, logits within 1e-3. Also: the routing rules against HF's
routers and their tie-breaking, decode in the absorbed form, the latent cache's bytes per
token and capacity, its int8 round trip, YaRN's frequencies.

The engine's invariance tests (batched, chunked, prefix hit, preempted; fp32 and int8 KV)
run the tiny DeepSeek models in tests/test_engine.py, TP=2 in tests/test_tensor_parallel.py.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_models_parity import PagedRunner, hf_greedy  # noqa: E402
from kvserve.config import ModelConfig  # noqa: E402
from kvserve.kv_cache import KVCache, KVCacheSpec, LatentKV  # noqa: E402
from kvserve.loader import load_model, resolve_model  # noqa: E402
from kvserve.loader.resolve import ModelSource  # noqa: E402
from kvserve.models.routing import group_limited_greedy, noaux_tc, top_k_lowest_index_first  # noqa: E402
from kvserve.models.testing import build_random_model, hf_module_state_dict, tiny_config, to_hf_config  # noqa: E402

LOGITS_ATOL = 1e-3
ARCHS = ["deepseek_v2", "deepseek_v3"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _hf_reference(model, config):
    """HF's own model of ``config``'s shape holding ``model``'s weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(to_hf_config(config), dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(hf_module_state_dict(model), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return hf


# ------------------------------------------------------------------ against HF's models


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_match_hf(arch):
    """tiny-deepseek-v2: q_lora_rank None, group_limited_greedy, a shared expert, layer 0
    dense. tiny-deepseek-v3: q_lora_rank 48, noaux_tc over 4 groups, values wider than the
    keys' nope part, YaRN. Three prompts as one batch on shuffled blocks, 12 batched decode
    steps (absorbed) after the prefill (expanded), against HF's incremental loop."""
    config = tiny_config(arch)
    model = build_random_model(config, seed=3)
    hf = _hf_reference(model, config)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (30, 5, 17)]
    runner = PagedRunner(model, config, [len(p) + 13 for p in prompts])
    ours_logits, ours_tokens = runner.greedy(prompts, 12)
    worst = 0.0
    for s, prompt in enumerate(prompts):
        hf_logits, hf_tokens = hf_greedy(hf, prompt, 12)
        assert ours_tokens[s] == hf_tokens
        worst = max(worst, *(_max_diff(ours_logits[step][s], hf_logits[step]) for step in range(13)))
    print(f"\n{arch}: max|diff| vs HF {worst:.2e}")
    assert worst < LOGITS_ATOL


def _hf_tiny(variant: str):
    """A random tiny HF DeepSeek model (fp32, eval), its 1-D parameters (norms, the V3
    correction bias) perturbed so that they matter, its matrices (experts' 3-D stacks
    included) redrawn at ``1 / sqrt(fan_in)`` instead of HF's 0.02 std, so that attention,
    rope and routing visibly move the logits."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    if variant == "v2-lite":  # V2-Lite's routing (greedy, 1.0) and its YaRN parameters
        hf_config = DeepseekV2Config(q_lora_rank=None, topk_method="greedy", rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}, **common)
    elif variant == "v2-grouped":
        hf_config = DeepseekV2Config(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                     routed_scaling_factor=16.0, **common)
    else:  # v3 (pairwise rope) and v3-halves (rope_interleave False)
        hf_config = DeepseekV3Config(q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                                     routed_scaling_factor=2.5, rope_interleave=variant == "v3", **common)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith("e_score_correction_bias") or (p.dim() == 1 and "rotary" not in name):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() >= 2 and "embed_tokens" not in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return hf


@pytest.mark.parametrize("variant", ["v2-lite", "v2-grouped", "v3", "v3-halves"])
def test_from_safetensors_matches_hf(tmp_path, variant):
    """An HF directory written by transformers' save_pretrained (one tensor per expert, the
    V3 correction bias, HF's config keys) loads, and runs as HF's model does."""
    hf = _hf_tiny(variant)
    hf.save_pretrained(tmp_path)
    model, config = load_model(ModelSource(kind="hf_dir", path=str(tmp_path), name="tmp"))
    assert config.architecture == ("deepseek_v2" if variant.startswith("v2") else "deepseek_v3")
    assert config.mlp_only_layers == [0] and config.n_shared_experts == 2
    assert model.model.fused_layers is None and not model.layer_spec.native  # MLA + MoE: layer by layer
    if variant == "v2-lite":
        assert config.q_lora_rank is None and config.rope_scaling["rope_type"] == "yarn"
    if variant.startswith("v3"):
        assert (config.topk_method, config.rope_interleave) == ("noaux_tc", variant == "v3")
    prompt = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    ours_logits, ours_tokens = PagedRunner(model, config, [48]).greedy([prompt], 16)
    hf_logits, hf_tokens = hf_greedy(hf, prompt, 16)
    assert ours_tokens[0] == hf_tokens
    worst = max(_max_diff(ours_logits[step][0], hf_logits[step]) for step in range(17))
    print(f"\n{variant}: max|diff| vs HF {worst:.2e}")
    assert worst < LOGITS_ATOL


# ------------------------------------------------------------------ routing


def test_grouped_routing_matches_hf_routers():
    """kvserve's group_limited_greedy and noaux_tc choose HF's experts with HF's weights (on
    logits without ties, where HF's topk order is defined)."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen)
    common = dict(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                  topk_group=2)
    v2 = DeepseekV2TopkRouter(DeepseekV2Config(topk_method="group_limited_greedy", routed_scaling_factor=1.0, **common))
    v3 = DeepseekV3TopkRouter(DeepseekV3Config(norm_topk_prob=True, routed_scaling_factor=1.0, **common))
    with torch.no_grad():
        for router in (v2, v3):
            router.weight.copy_(torch.randn(16, 16, generator=gen))
        v3.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    logits = x @ v2.weight.T
    for (_, hf_weights, hf_experts), (weights, experts) in [
        (v2(x), group_limited_greedy(logits, 4, 4, 2)),
        (v3(x), noaux_tc(x @ v3.weight.T, v3.e_score_correction_bias, 4, 4, 2, normalize=True)),
    ]:
        hf_order = hf_experts.sort(dim=-1)
        ours_order = experts.sort(dim=-1)
        assert torch.equal(ours_order.values, hf_order.values)
        assert torch.allclose(weights.gather(1, ours_order.indices), hf_weights.gather(1, hf_order.indices),
                              atol=1e-6)


def test_grouped_routing_breaks_ties_by_index():
    # Groups of 2: {0,1} {2,3} {4,5}; groups 1 and 2 tie on their best expert (0.3 each), so
    # the lower group (1) is kept; experts 2 and 3 tie within it: both taken, in order.
    logits = torch.log(torch.tensor([[0.1, 0.1, 0.3, 0.3, 0.3, 0.0 + 1e-9]]))
    _, experts = group_limited_greedy(logits, 2, n_group=3, topk_group=1)
    assert experts.tolist() == [[2, 3]]
    # noaux_tc: equal sigmoid scores everywhere, a zero bias: the first groups, the lowest ids.
    _, experts = noaux_tc(torch.zeros(1, 8), torch.zeros(8), 3, n_group=4, topk_group=2, normalize=True)
    assert experts.tolist() == [[0, 1, 2]]
    values, indices = top_k_lowest_index_first(torch.tensor([[1.0, 2.0, 2.0, 1.0]]), 3)
    assert indices.tolist() == [[1, 2, 0]] and values.tolist() == [[2.0, 2.0, 1.0]]


# ------------------------------------------------------------------ MLA


def test_decode_uses_the_absorbed_form_and_prefill_expands():
    """A step of decodes only never expands a latent to per-head keys (kv_b_proj's expand
    is not called; the query is absorbed instead); a prompt chunk expands once per layer."""
    model, config = load_model(resolve_model("tiny-deepseek-v2"))
    calls = {"absorb_query": 0, "expand": 0}
    for layer in model.model.layers:
        up = layer.self_attn.kv_b_proj
        for name in calls:
            original = getattr(up, name)

            def counted(*args, _name=name, _original=original):
                calls[_name] += 1
                return _original(*args)
            setattr(up, name, counted)
    runner = PagedRunner(model, config, [40, 40])
    runner.step([list(range(100, 120)), list(range(200, 220))])  # (one decode plan: equal lengths)
    assert calls == {"absorb_query": 0, "expand": 2 * config.num_hidden_layers}
    runner.step([[5], [6]])
    assert calls == {"absorb_query": config.num_hidden_layers, "expand": 2 * config.num_hidden_layers}


@pytest.mark.parametrize("arch", ARCHS)
def test_absorbed_decode_equals_expanded_prefill(arch):
    """A token's logits decoded after a prompt (absorbed) equal the prompt-and-token prefilled
    at once (expanded), up to rounding."""
    config = tiny_config(arch)
    model = build_random_model(config, seed=5)
    prompt = torch.randint(3, config.vocab_size, (25,), generator=torch.Generator().manual_seed(2)).tolist()
    decoded = PagedRunner(model, config, [32])
    decoded.step([prompt[:-1]])
    prefilled = PagedRunner(model, config, [32], seed=1).step([prompt])
    assert _max_diff(decoded.step([prompt[-1:]]), prefilled) < 1e-4


V2_LITE = dict(num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128)


def _v2_lite_config() -> ModelConfig:
    """DeepSeek-V2-Lite's attention shape (27 layers, 16 heads, latent 512, rope 64, nope 128,
    values 128); the rest of the model does not touch the KV cache."""
    config = tiny_config("deepseek_v2")
    for key, value in V2_LITE.items():
        setattr(config, key, value)
    config.head_dim, config.num_key_value_heads = 128 + 64, 16
    return config


@pytest.mark.parametrize("config_of", [lambda: tiny_config("deepseek_v2"), lambda: tiny_config("deepseek_v3"),
                                       _v2_lite_config], ids=["tiny-v2", "tiny-v3", "v2-lite"])
@pytest.mark.parametrize("dtype,element_bytes", [("bfloat16", 2), ("float32", 4)])
def test_latent_kv_bytes_per_token_are_the_latent_formula(config_of, dtype, element_bytes):
    config = config_of()
    spec = KVCacheSpec.for_model(config, 16, dtype)
    expected = (config.kv_lora_rank + config.qk_rope_head_dim) * element_bytes * config.num_hidden_layers
    assert spec.latent == LatentKV(config.kv_lora_rank, config.qk_rope_head_dim)
    assert spec.bytes_per_token == expected
    assert spec.bytes_per_block == expected * 16
    assert f"= {expected} bytes per token" in spec.describe_token()
    cache = KVCache.allocate(spec, 3, "cpu") if config.num_hidden_layers < 8 else None
    if cache is not None:  # the allocated tensors are what the spec says
        assert cache.num_bytes == 3 * spec.bytes_per_block and cache.num_blocks == 3


def test_latent_capacity_at_a_fixed_budget_vs_the_expanded_cache():
    """DeepSeek-V2-Lite's shape, bf16, a 1 GiB KV budget: the latent cache holds (512 + 64) x 2
    bytes x 27 layers per token. The same model's per-head cache as kvserve holds per-head KV
    (``[2, heads, blocks, block, head_dim]``: keys and values at one head width, the keys' nope
    + rope = 192) costs 2 x 16 x 192 x 2 x 27 bytes: 10.7x the tokens in the same memory. (Keys
    and values each at their own width, 192 and 128, would cost 8.9x.)"""
    config = _v2_lite_config()
    budget, block = 1 << 30, 16
    latent = KVCacheSpec.for_model(config, block, "bfloat16")
    assert latent.bytes_per_token == (512 + 64) * 2 * 27
    expanded = KVCacheSpec(27, 16, 128 + 64, block, "bfloat16")  # computed from the shape, not allocated
    tokens = {name: budget // spec.bytes_per_block * block for name, spec in
              (("latent", latent), ("expanded", expanded))}
    ratio = tokens["latent"] / tokens["expanded"]
    unequal_kv_bytes = 16 * (192 + 128) * 2 * 27
    print(f"\nV2-Lite bf16, 1 GiB: latent {latent.bytes_per_token} B/token, {tokens['latent']} tokens; "
          f"per-head {expanded.bytes_per_token} B/token, {tokens['expanded']} tokens: {ratio:.2f}x "
          f"({unequal_kv_bytes / latent.bytes_per_token:.2f}x against K 192 + V 128 per head)")
    assert ratio >= 10
    int8 = KVCacheSpec.for_model(config, block, "int8")
    assert int8.bytes_per_token == ((512 + 64) + (512 // 32 + 64 // 32) * 2) * 27  # values + fp16 scales per 32


def test_engine_sizes_and_describes_the_latent_cache(llm_factory):
    llm = llm_factory(model="tiny-deepseek-v3", dtype="float32", kv_cache_memory=4 << 20)
    engine = llm.engine
    per_token = (32 + 16) * 4 * 3
    assert engine.kv_spec.bytes_per_token == per_token
    assert engine.kv_cache_tokens == (4 << 20) // (per_token * 16) * 16
    line = engine.describe_kv_cache()
    assert f"(32 latent + 16 rope key) x 4 bytes = {per_token} bytes per token" in line


def test_int8_latent_cache_round_trip():
    spec = KVCacheSpec.for_model(tiny_config("deepseek_v2"), 16, "int8")
    layer = KVCache.allocate(spec, 4, "cpu")[0]
    gen = torch.Generator().manual_seed(0)
    latent, rope_key = torch.randn(20, 32, generator=gen), 5 * torch.randn(20, 16, generator=gen)
    slots = torch.randperm(64, generator=gen)[:20]
    layer.write(latent, rope_key, slots)
    back = layer.gather(torch.arange(4), torch.float32)[slots]
    # Per part, within half a quantization step of its own scale (each part rotated alone: the
    # rope key's larger values do not coarsen the latent's steps).
    for part, (a, b) in ((latent, (0, 32)), (rope_key, (32, 48))):
        step = part.abs().max() * 2 / 127
        assert (back[:, a:b] - part).abs().max() < step
    assert (back[:, :32] - latent).abs().max() < 0.1


def test_yarn_frequencies_and_scale_match_hf():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from kvserve.models.layers import rope_inv_freq, yarn_attention_factor
    from kvserve.models.mla import mla_softmax_scale

    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    hf_config = DeepseekV3Config(qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840,
                                 rope_parameters={"rope_theta": 10000.0, **scaling})
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert torch.equal(rope_inv_freq(64, 10000.0, scaling, "cpu"), hf_inv_freq)
    assert yarn_attention_factor(scaling) == pytest.approx(hf_factor, rel=1e-12)
    config = tiny_config("deepseek_v3")
    config.qk_nope_head_dim, config.qk_rope_head_dim, config.rope_scaling = 128, 64, scaling
    assert mla_softmax_scale(config) == pytest.approx(yarn_apply_mscale(hf_config.rope_parameters, 192 ** -0.5),
                                                      rel=1e-12)


# ------------------------------------------------------------------ real configs


V2_LITE_CONFIG = {  # DeepSeek-V2-Lite's config.json (hub, abridged), DeepSeek's own key names
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 163840,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
    "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": False,
}
V3_CONFIG = {  # DeepSeek-V3's (abridged, its fp8 quantization_config left out)
    **V2_LITE_CONFIG, "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def test_hf_configs_of_v2_lite_and_v3():
    from kvserve.config import ConfigError
    from kvserve.loader.safetensors import config_from_hf

    cfg = config_from_hf(V2_LITE_CONFIG)
    assert (cfg.architecture, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim) == ("deepseek_v2", None, 512, 192)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.topk_method) == (64, 6, 2, "greedy")
    assert cfg.mlp_only_layers == [0] and all(cfg.is_moe_layer(i) for i in range(1, 27))
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["mscale_all_dim"] == 0.707
    assert KVCacheSpec.for_model(cfg, 16, "bfloat16").bytes_per_token == (512 + 64) * 2 * 27
    cfg = config_from_hf(V3_CONFIG)
    assert (cfg.architecture, cfg.q_lora_rank, cfg.topk_method, cfg.n_group, cfg.topk_group) == \
        ("deepseek_v3", 1536, "noaux_tc", 8, 4)
    assert cfg.mlp_only_layers == [0, 1, 2] and cfg.norm_topk_prob and cfg.routed_scaling_factor == 2.5
    with pytest.raises(ConfigError, match="fp8-quantized"):
        config_from_hf(dict(V3_CONFIG, quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ConfigError, match="1 groups of 1 experts cannot give 2"):
        config_from_hf(dict(V2_LITE_CONFIG, n_routed_experts=8, num_experts_per_tok=2,
                            topk_method="group_limited_greedy", n_group=8, topk_group=1))
    with pytest.raises(ConfigError, match="topk_method"):
        config_from_hf(dict(V2_LITE_CONFIG, topk_method="random"))


def test_v3_skips_the_multi_token_prediction_layer(tmp_path):
    """V3 checkpoints carry a multi-token-prediction layer after the decoder's (layer
    ``num_hidden_layers``): loaded past, as HF does, not refused."""
    from safetensors.torch import load_file, save_file

    hf = _hf_tiny("v3")
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(48, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    model, _ = load_model(ModelSource(kind="hf_dir", path=str(tmp_path), name="tmp"))
    assert len(model.model.layers) == 3
