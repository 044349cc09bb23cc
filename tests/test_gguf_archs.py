"""Issue 62's architectures from GGUF files written as llama.cpp's converter writes them
(tests/gguf_export.py): Qwen3-MoE (3-D expert stacks, router, expert metadata), Phi-3 with
LongRoPE (rope_factors tensors), DeepSeek V2/V3 (MLA tensors, kv_b_proj whole or split into
attn_k_b / attn_v_b, shared experts, exp_probs_b, dense first layers). fp32: greedy tokens
identical and logits within 1e-3 against transformers' own GGUF loader where it reads the
architecture (qwen3moe), else against HF's model of the weights the file was written from.
A quantized Qwen3-MoE file keeps its experts in their block formats (each expert's slice of
the stack read like a 2-D tensor), with the values of gguf's dequantization.
(Qwen3 and Phi-3 without LongRoPE: tests/test_loader.py.)
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gguf_export import export_gguf  # noqa: E402
from test_deepseek import _hf_reference  # noqa: E402
from test_models_parity import PagedRunner, hf_greedy  # noqa: E402
from kvserve import ops  # noqa: E402
from kvserve.config import ConfigError  # noqa: E402
from kvserve.loader import load_model, resolve_model, source_has_blocks  # noqa: E402
from kvserve.loader.gguf import open_gguf  # noqa: E402
from kvserve.models.testing import build_random_model, tiny_config  # noqa: E402
from kvserve.quant import DecodeFormatLinear, use_invariant_fp32_linears  # noqa: E402

LOGITS_ATOL = 1e-3
VOCAB = 512  # (no tokenizer drives these models: a small vocabulary keeps the files small)
needs_kernels = pytest.mark.skipif(ops.load_extension() is None, reason="the fused CPU kernels are not built")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _prompt(n: int = 20, seed: int = 5) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tiny(arch: str, **changes):
    config = tiny_config(arch)
    config.vocab_size = VOCAB
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _assert_matches(model, config, reference, steps: int = 16) -> float:
    """kvserve's greedy run of one prompt against HF's incremental loop: the same tokens,
    logits within LOGITS_ATOL; the worst difference."""
    prompt = _prompt()
    ours_logits, ours_tokens = PagedRunner(model, config, [len(prompt) + steps + 1]).greedy([prompt], steps)
    hf_logits, hf_tokens = hf_greedy(reference, prompt, steps)
    assert ours_tokens[0] == hf_tokens
    worst = max(_max_diff(ours_logits[step][0], hf_logits[step]) for step in range(steps + 1))
    assert worst < LOGITS_ATOL, worst
    return worst


# ------------------------------------------------------------------ Qwen3-MoE


def test_qwen3_moe_gguf_matches_transformers_gguf_loader(tmp_path):
    """A qwen3moe file (every layer routed, as llama.cpp's own files) read by kvserve and by
    transformers' GGUF loader. (transformers takes the experts' width from its config default,
    768, not from expert_feed_forward_length: a model of that width reads the same in both.)"""
    config = _tiny("qwen3_moe", mlp_only_layers=[], moe_intermediate_size=768)
    path = tmp_path / "qwen3moe.gguf"
    export_gguf(build_random_model(config, seed=7), config, "qwen3moe", path)
    model, loaded = load_model(resolve_model(str(path)))
    assert loaded.architecture == "qwen3_moe" and loaded.mlp_only_layers == []
    assert (loaded.num_experts, loaded.num_experts_per_tok, loaded.moe_intermediate_size) == (8, 2, 768)
    assert loaded.norm_topk_prob and loaded.head_dim == config.head_dim
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    worst = _assert_matches(model, loaded, reference)
    print(f"\nqwen3moe GGUF: max|diff| vs transformers' GGUF loader {worst:.2e}")


@pytest.mark.parametrize("stored", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_qwen3_moe_gguf_with_dense_layers_is_the_model_it_was_written_from(tmp_path, stored):
    """A layer without a router (HF's mlp_only_layers: tiny-qwen3-moe's layer 1; transformers'
    GGUF loader cannot express it) keeps its dense MLP. The matrices stored as F32, F16 or BF16
    (3-D expert stacks included; the router stays F32): every weight is the source model's,
    rounded as stored, so every logit is that model's, bit for bit
    (tests/test_models_parity.py checks the source model against HF)."""
    config = _tiny("qwen3_moe")
    source = build_random_model(config, seed=7)
    path = tmp_path / f"qwen3moe-dense1-{stored.name}.gguf"
    export_gguf(source, config, "qwen3moe", path, quantize=stored != T.F32, qtype=stored)
    rounding = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[stored]
    with torch.no_grad():
        for name, param in source.named_parameters():
            if param.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                param.copy_(param.to(rounding).float())
    use_invariant_fp32_linears(source)  # (the kernels load_model gives the loaded model)
    model, loaded = load_model(resolve_model(str(path)))
    assert loaded.mlp_only_layers == [1] and loaded.moe_intermediate_size == config.moe_intermediate_size
    assert torch.equal(model.model.layers[2].mlp.experts[5].down_proj.weight,
                       source.model.layers[2].mlp.experts[5].down_proj.weight)
    prompt = _prompt()
    want, want_tokens = PagedRunner(source, config, [40]).greedy([prompt], 8)
    got, got_tokens = PagedRunner(model, loaded, [40]).greedy([prompt], 8)
    assert got_tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_kernels
@pytest.mark.parametrize("experts", [T.Q8_0, T.Q4_0, T.Q4_K], ids=lambda t: t.name)
def test_quantized_qwen3_moe_experts_stay_in_their_blocks(tmp_path, experts):
    """A quantized qwen3moe file (Q8_0 matrices; the expert stacks in ``experts``: quantized by
    gguf, or random K-quant blocks, which gguf cannot quantize): the default GGUF path holds every
    expert's gate+up and down in a block format (no float copy, nothing in bf16), each the
    file's values exactly (gguf's dequantization of its slice); the model's logits are the
    dequantized fp32 model's within the kernels' rounding, its greedy tokens the same, and a
    prompt's logits alone and inside a batch bit for bit the same."""
    # (K-quants' blocks are 256 wide: the hidden and expert widths are multiples of 256)
    config = _tiny("qwen3_moe", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   moe_intermediate_size=256)
    path = tmp_path / f"qwen3moe-{experts.name}.gguf"
    export_gguf(build_random_model(config, seed=7), config, "qwen3moe", path, quantize=True, expert_type=experts)
    source = resolve_model(str(path))
    assert source_has_blocks(source)
    model, loaded = load_model(source, quantization="gguf")
    reference, _ = load_model(source)  # every weight dequantized to fp32
    assert not any("bf16" in kind for kind in model.weight_format_counts), model.weight_format_counts
    gf = open_gguf(str(path))
    for layer in range(config.num_hidden_layers):
        if not loaded.is_moe_layer(layer):
            continue
        stacks = {proj: gguf.quants.dequantize(gf.raw(f"blk.{layer}.ffn_{proj}_exps.weight"), experts)
                  for proj in ("gate", "up", "down")}
        for e, expert in enumerate(model.model.layers[layer].mlp.experts):
            for name, want in (("gate_up_proj", np.concatenate([stacks["gate"][e], stacks["up"][e]])),
                               ("down_proj", stacks["down"][e])):
                linear = getattr(expert, name)
                # (a block-format layer, and no float copy of it for prompt tokens)
                assert isinstance(linear, DecodeFormatLinear) and linear.prefill is None, type(linear)
                assert torch.equal(linear.dequantized(), torch.from_numpy(want)), (layer, e, name)
                assert torch.equal(linear.dequantized(),
                                   getattr(reference.model.layers[layer].mlp.experts[e], name).weight)
    prompt = _prompt()
    got, got_tokens = PagedRunner(model, loaded, [40]).greedy([prompt], 8)
    want, want_tokens = PagedRunner(reference, loaded, [40]).greedy([prompt], 8)
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        assert _max_diff(a, b) < 1e-3 * b.abs().max().item()  # (measured: 1e-7 to 1.2e-5 on Ice Lake)
    other = [_prompt(13, seed=8), _prompt(31, seed=9)]
    batched, _ = PagedRunner(model, loaded, [40, 40, 40]).greedy([other[0], prompt, other[1]], 4)
    alone, _ = PagedRunner(model, loaded, [40], seed=4).greedy([prompt], 4)
    assert all(torch.equal(a[1], b[0]) for a, b in zip(batched, alone))


def test_expert_stacks_must_match_the_metadata(tmp_path):
    config = _tiny("qwen3_moe", mlp_only_layers=[])
    path = tmp_path / "bad.gguf"
    export_gguf(build_random_model(config, seed=7), config, "qwen3moe", path,
                metadata_overrides={"qwen3moe.expert_count": 6})
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_gate_exps\.weight has shape \(8, 32, 64\), "
                       r"the metadata describes \(6, 32, 64\)"):
        load_model(resolve_model(str(path)))


# ------------------------------------------------------------------ Phi-3 LongRoPE


def test_phi3_longrope_gguf_matches_hf(tmp_path):
    """Phi-3 with LongRoPE factors (rope_factors_long / _short) and an original context of 32
    tokens: decoding from a 20-token prompt crosses from the short factors to the long ones,
    as HF's model of the same weights does."""
    gen = torch.Generator().manual_seed(9)
    short = (1.0 + 3.0 * torch.rand(8, generator=gen)).tolist()
    long = (1.0 + 30.0 * torch.rand(8, generator=gen)).tolist()
    config = _tiny("phi3", max_position_embeddings=256, rope_scaling={
        "rope_type": "longrope", "short_factor": short, "long_factor": long, "original_max_position_embeddings": 32})
    source = build_random_model(config, seed=7)
    path = tmp_path / "phi3-longrope.gguf"
    export_gguf(source, config, "phi3", path)
    model, loaded = load_model(resolve_model(str(path)))
    scaling = loaded.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 32
    assert np.allclose(scaling["long_factor"], long) and np.allclose(scaling["short_factor"], short)
    assert loaded.sliding_window is None
    worst = _assert_matches(model, loaded, _hf_reference(source, config), steps=24)
    print(f"\nphi3 LongRoPE GGUF: max|diff| vs HF {worst:.2e}")


# ------------------------------------------------------------------ DeepSeek V2/V3


@pytest.mark.parametrize("arch,split_kv_b", [("deepseek_v2", False), ("deepseek_v3", True)])
def test_deepseek2_gguf_matches_hf(tmp_path, arch, split_kv_b):
    """tiny-deepseek-v2 (no query bottleneck, group_limited_greedy, softmax router) as an older
    file (attn_kv_b whole, the heads' lengths in key_length / value_length); tiny-deepseek-v3
    (q_lora_rank, noaux_tc with exp_probs_b, sigmoid router, YaRN) as a newer one (attn_k_b /
    attn_v_b, the *_mla lengths). The file keeps YaRN's mscale_all_dim only: the V3 model's
    mscale is set equal to it, as in every released V2/V3."""
    config = _tiny(arch)
    if config.rope_scaling:
        config.rope_scaling = dict(config.rope_scaling, mscale=0.707, mscale_all_dim=0.707)
    source = build_random_model(config, seed=7)
    path = tmp_path / f"{arch}.gguf"
    export_gguf(source, config, "deepseek2", path, split_kv_b=split_kv_b)
    names = set(open_gguf(str(path)).tensors)
    assert ("blk.1.attn_k_b.weight" in names) == split_kv_b and ("blk.1.attn_kv_b.weight" in names) != split_kv_b
    model, loaded = load_model(resolve_model(str(path)))
    for field in ("architecture", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "mlp_only_layers", "num_experts", "num_experts_per_tok", "n_shared_experts", "topk_method",
                  "scoring_func", "n_group", "topk_group", "norm_topk_prob"):
        assert getattr(loaded, field) == getattr(config, field), field
    assert loaded.routed_scaling_factor == pytest.approx(config.routed_scaling_factor)
    if config.rope_scaling:
        assert loaded.rope_scaling["mscale_all_dim"] == 0.707 and loaded.rope_scaling["factor"] == 4.0
    worst = _assert_matches(model, loaded, _hf_reference(source, config))
    print(f"\n{arch} GGUF: max|diff| vs HF {worst:.2e}")


def test_deepseek2_unknown_gating_is_refused(tmp_path):
    config = _tiny("deepseek_v2")
    path = tmp_path / "bad.gguf"
    export_gguf(build_random_model(config, seed=7), config, "deepseek2", path,
                metadata_overrides={"deepseek2.expert_gating_func": 3})
    with pytest.raises(ConfigError, match="expert gating function 3 is not supported"):
        load_model(resolve_model(str(path)))
