"""Model resolution and loading: every bad input is a one-line ConfigError naming the problem;
config fields of both real GGUFs; GGUF files written the way llama.cpp writes them (q/k rows
permuted, Gemma norms stored as 1 + w, llama3 rope as a rope_freqs tensor) load back to the
same logits."""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve import ops
from kvserve.attention import build_attention_metadata
from kvserve.kv_cache import allocate_kv_cache
from kvserve.config import ConfigError
from kvserve.loader import load_model, resolve_model
from kvserve.loader.gguf import config_from_gguf, open_gguf, unpermute_rows
from kvserve.loader.gguf_reader import GGUFFile
from kvserve.loader.resolve import ModelSource
from kvserve.models.testing import build_random_model, tiny_config
from gguf_export import export_gguf, llama_cpp_permute

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma-3-270m"


def _expect_error(spec: str, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_model(spec)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ------------------------------------------------------------------ bad inputs


def test_unknown_name():
    _expect_error("llama-9000b", "unknown model 'llama-9000b'", SMOLLM2)


def test_missing_file(tmp_path):
    _expect_error(str(tmp_path / "nope.gguf"), "model file not found", "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model, just some text that is long enough\n")
    _expect_error(str(path), "not a GGUF file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _expect_error(str(path), "not a GGUF file")


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return Path(resolve_model(SMOLLM2).path)


def test_truncated_header(tmp_path, smollm2_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(smollm2_path.read_bytes()[:1000])  # cut inside the vocabulary metadata
    _expect_error(str(path), "truncated or corrupt GGUF header")


def test_truncated_tensor_data(tmp_path, smollm2_path):
    path = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        path.write_bytes(f.read(20_000_000))  # header intact, tensor data cut short
    message = _expect_error(str(path), "truncated GGUF", "ends at byte", "20000000")
    assert "tensor '" in message


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], raw_dtypes: dict | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=(raw_dtypes or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    _write_gguf(path, "mamba", {"token_embd.weight": np.zeros((8, 4), dtype=np.float32)})
    _expect_error(str(path), "unsupported architecture 'mamba'", "llama")


def test_unsupported_quant_type(tmp_path):
    path = tmp_path / "q8_1.gguf"
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((4, type_size), dtype=np.uint8)  # 4 rows of one Q8_1 block
    _write_gguf(path, "llama", {"token_embd.weight": raw}, {"token_embd.weight": gguf.GGMLQuantizationType.Q8_1})
    _expect_error(str(path), "unsupported quant type Q8_1", "token_embd.weight")


def test_hf_dir_with_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    _expect_error(str(tmp_path), "unsupported model_type 'bert'")


def test_hf_configs_of_phi3_128k_and_qwen3_moe():
    """Real models' config.json shapes (values from their hub configs, abridged): Phi-3-mini-128k's
    LongRoPE under its first name ("su") and a window past its context; Phi-4-mini's partial
    rotary embeddings, refused; Qwen3-30B-A3B's experts."""
    from kvserve.loader.safetensors import config_from_hf

    phi3 = {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    cfg = config_from_hf(phi3)
    assert (cfg.architecture, cfg.head_dim, cfg.sliding_window, cfg.layer_types) == ("phi3", 96, None, None)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    with pytest.raises(ConfigError, match="partial rotary"):
        config_from_hf(dict(phi3, rope_scaling=None, partial_rotary_factor=0.75))
    qwen3_moe = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "use_sliding_window": False, "sliding_window": None, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}
    cfg = config_from_hf(qwen3_moe)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (128, 8, 768, True)
    assert all(cfg.is_moe_layer(i) for i in range(48)) and cfg.layer_types is None


def test_hf_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    _expect_error(str(tmp_path), "no *.safetensors")


def test_hf_dir_without_config(tmp_path):
    _expect_error(str(tmp_path), "no config.json")


# ------------------------------------------------------------------ real GGUF metadata


def test_smollm2_config():
    assert resolve_model().name == SMOLLM2  # the default model
    cfg = config_from_gguf(open_gguf(resolve_model(SMOLLM2).path))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rope_theta) == (49152, 8192, 100000.0)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, [2])
    assert cfg.sliding_window is None and cfg.layer_types is None and cfg.hidden_act == "silu"


def test_gemma3_config():
    cfg = config_from_gguf(open_gguf(resolve_model(GEMMA3).path))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("gemma3", 18, 640, 2048)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (262144, 32768)
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1e6, 1e4)
    assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (2, [1])


def test_reader_agrees_with_gguf_package(smollm2_path):
    ours = GGUFFile(smollm2_path)
    reference = gguf.GGUFReader(smollm2_path)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        value = value.tolist() if isinstance(value, np.ndarray) else value
        assert value == field.contents(), key
    assert [t.name for t in reference.tensors] == list(ours.tensors)
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert info.quant_type == t.tensor_type and info.dims == tuple(int(d) for d in t.shape)
        assert np.array_equal(ours.raw(t.name).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel())


def test_gemma_is_assembled_once(tmp_path):
    stale = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    stale.write_bytes(b"GGUF half written")
    source = resolve_model(GEMMA3, cache_dir=tmp_path)
    assert Path(source.path) == stale
    first = os.stat(source.path)
    assert first.st_size > 200_000_000
    again = os.stat(resolve_model(GEMMA3, cache_dir=tmp_path).path)
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert not list(tmp_path.glob("*.partial"))


# ------------------------------------------------------------------ llama.cpp conventions


def test_unpermute_invertsllama_cpp_permute():
    hf = np.random.default_rng(0).standard_normal((3 * 8, 5))
    stored = llama_cpp_permute(hf, 3)
    assert not np.array_equal(stored, hf)
    assert np.array_equal(stored[unpermute_rows(24, 3)], hf)


def _logits(model, cfg, tokens: list[int]) -> torch.Tensor:
    caches = allocate_kv_cache(cfg, 8, 16, torch.float32, "cpu")
    md = build_attention_metadata([[5, 2, 7]], [0], [len(tokens)], 16)
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(len(tokens)), md, caches,
                     torch.arange(len(tokens)))


@pytest.mark.parametrize("gguf_arch,quantize", [("llama", False), ("llama", True), ("qwen2", False),
                                                ("gemma3", False), ("llama3-rope", False), ("qwen3", False),
                                                ("phi3", False), ("phi3", True)])
def test_gguf_written_like_llama_cpp_loads_back(tmp_path, gguf_arch, quantize):
    cfg = tiny_config(gguf_arch if gguf_arch in ("gemma3", "qwen3", "phi3") else "llama")
    if gguf_arch == "qwen2":
        cfg.architecture, cfg.attention_bias = "qwen2", True
    if gguf_arch == "llama3-rope":
        gguf_arch = "llama"
        cfg.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    original = build_random_model(cfg, seed=7)
    path = tmp_path / "tiny.gguf"
    export_gguf(original, cfg, gguf_arch, path, quantize)

    loaded, loaded_cfg = load_model(resolve_model(str(path)))
    assert loaded_cfg.architecture == cfg.architecture
    assert loaded_cfg.layer_types == cfg.layer_types and loaded_cfg.attention_bias == cfg.attention_bias
    tokens = torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    expected, got = _logits(original, cfg, tokens), _logits(loaded, loaded_cfg, tokens)
    if quantize:  # Q8_0 rounding: close, not equal
        assert (got - expected).abs().max() < 0.05 * expected.abs().max()
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
    else:
        assert (got - expected).abs().max() < 1e-4


@pytest.mark.parametrize("gguf_arch", ["qwen3", "phi3"])
def test_gguf_of_new_architectures_matches_transformers_gguf_loader(tmp_path, gguf_arch):
    """Issue 62: a qwen3 / phi3 GGUF written as llama.cpp's converter writes it (phi3: fused
    attn_qkv and gate+up ffn_up) read by kvserve and by transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(gguf_arch)
    if gguf_arch == "qwen3":
        # transformers' GGUF loader takes Qwen3's head_dim from its config default (128), not
        # from attention.key_length: a model of that head dimension reads the same in both.
        cfg.head_dim = 128
    original = build_random_model(cfg, seed=7)
    path = tmp_path / "tiny.gguf"
    export_gguf(original, cfg, gguf_arch, path, quantize=False)
    loaded, loaded_cfg = load_model(resolve_model(str(path)))
    assert (loaded_cfg.architecture, loaded_cfg.head_dim) == (gguf_arch, cfg.head_dim)
    assert (loaded.model.fused_layers is not None) == (ops.load_extension() is not None)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    tokens = torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([tokens])).logits[0].float()
    got = _logits(loaded, loaded_cfg, tokens)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() < 1e-3


def test_raw_quantized_weights_are_reachable():
    from kvserve.loader.gguf import quantized_weights

    source = resolve_model(SMOLLM2)
    gf = open_gguf(source.path)
    cfg = config_from_gguf(gf)
    raw = quantized_weights(gf, cfg)
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.quant_type == gguf.GGMLQuantizationType.Q4_1 and q.shape == (576, 576)
    assert raw["model.embed_tokens.weight"].quant_type == gguf.GGMLQuantizationType.Q8_0
    # Dequantizing the (un-permuted) raw rows gives exactly the loaded weight.
    from kvserve.loader.gguf import iter_gguf_weights

    loaded = next(t for n, t in iter_gguf_weights(gf, cfg) if n == "model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(q.data, q.quant_type)), loaded)


# ------------------------------------------------------------------ tiny models


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-phi3", "tiny-mistral-swa"])
def test_tiny_models_build(name):
    source = resolve_model(name)
    assert source == ModelSource(kind="tiny", path=None, name=name)
    model, cfg = load_model(source, dtype=torch.bfloat16)
    assert cfg.vocab_size == 49152 and next(model.parameters()).dtype == torch.bfloat16
    logits = _logits(model, cfg, [1, 2, 3, 4, 5])
    assert logits.shape == (5, 49152) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    # Deterministic: the same name builds the same weights.
    again, _ = load_model(source, dtype=torch.bfloat16)
    assert torch.equal(_logits(again, cfg, [1, 2, 3, 4, 5]), logits)
