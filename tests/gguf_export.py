"""Tiny GGUF files written the way llama.cpp's converter (convert_hf_to_gguf.py) writes a
checkpoint, from a kvserve model's HF-named weights: tensor names through gguf's own name map,
llama's q/k rows permuted, Gemma's norms as 1 + w, llama3 rope as a rope_freqs tensor, Phi-3's
LongRoPE as rope_factors tensors, each MoE layer's experts stacked into 3-D tensors, DeepSeek's
kv_b_proj split into attn_k_b / attn_v_b (newer files) or kept whole (older ones), and each
architecture's metadata keys. The loader under test never writes these files."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import gguf
import numpy as np

from kvserve.models.testing import unfused_state_dict

GGUF_ARCH_ENUMS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
                   "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
                   "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Kept in float32 by the converter whatever the file type (besides 1-D tensors and norms).
_F32_TENSORS = ("ffn_gate_inp.weight", "exp_probs_b.bias")


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in effect."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 rope scaling."""
    s = cfg.rope_scaling
    base = cfg.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _checkpoint_tensors(model, cfg, gguf_arch: str, split_kv_b: bool) -> dict[str, np.ndarray]:
    """HF-named arrays as the converter renames them: routed experts stacked per layer and
    projection (``model.layers.N.mlp.experts.gate_proj.weight`` ``[E, out, in]``), DeepSeek's
    kv_b_proj split into k_b_proj ``[heads, rank, nope]`` and v_b_proj ``[heads, v, rank]``."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in unfused_state_dict(model).items():
        array = tensor.float().numpy()
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = array
            continue
        if gguf_arch == "deepseek2" and name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            per_head = array.reshape(heads, nope + v, -1)
            out[name.replace("kv_b_proj", "k_b_proj")] = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            out[name.replace("kv_b_proj", "v_b_proj")] = np.ascontiguousarray(per_head[:, nope:])
            continue
        out[name] = array
    for (layer, proj), per_expert in experts.items():
        out[f"model.layers.{layer}.mlp.experts.{proj}.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def _metadata(w: gguf.GGUFWriter, cfg, gguf_arch: str, split_kv_b: bool) -> None:
    a = gguf_arch
    w.add_uint32(f"{a}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", cfg.num_attention_heads)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{a}.vocab_size", cfg.vocab_size)  # (transformers' GGUF loader reads it)
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_ids[0])
    if gguf_arch == "deepseek2":
        _deepseek2_metadata(w, cfg, split_kv_b)
        return
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    if gguf_arch == "gemma3":
        w.add_uint32("gemma3.attention.sliding_window", cfg.sliding_window)
        w.add_array("gemma3.attention.sliding_window_pattern", [t == "sliding_attention" for t in cfg.layer_types])
    if gguf_arch == "qwen3moe":
        w.add_uint32(f"{a}.expert_count", cfg.num_experts)
        w.add_uint32(f"{a}.expert_used_count", cfg.num_experts_per_tok)
        w.add_uint32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if gguf_arch == "phi3":
        scaling = cfg.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", original)
        w.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
        w.add_uint32(f"{a}.attention.sliding_window", cfg.sliding_window or 0)
        if scaling.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / original
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            w.add_float32(f"{a}.rope.scaling.attn_factor", attn_factor)


def _deepseek2_metadata(w: gguf.GGUFWriter, cfg, split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters: MLA as MQA (one KV head), newer files with the
    latent's lengths as key/value lengths and the heads' in the *_mla keys."""
    a = "deepseek2"
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_uint32(f"{a}.attention.head_count_kv", 1)
    w.add_uint32(f"{a}.leading_dense_block_count", len(cfg.mlp_only_layers))
    if cfg.q_lora_rank:
        w.add_uint32(f"{a}.attention.q_lora_rank", cfg.q_lora_rank)
    w.add_uint32(f"{a}.attention.kv_lora_rank", rank)
    if split_kv_b:
        w.add_uint32(f"{a}.attention.key_length", rank + rope)
        w.add_uint32(f"{a}.attention.value_length", rank)
        w.add_uint32(f"{a}.attention.key_length_mla", cfg.qk_nope_head_dim + rope)
        w.add_uint32(f"{a}.attention.value_length_mla", cfg.v_head_dim)
    else:
        w.add_uint32(f"{a}.attention.key_length", cfg.qk_nope_head_dim + rope)
        w.add_uint32(f"{a}.attention.value_length", cfg.v_head_dim)
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)
    w.add_uint32(f"{a}.expert_count", cfg.num_experts)
    w.add_uint32(f"{a}.expert_used_count", cfg.num_experts_per_tok)
    w.add_uint32(f"{a}.expert_shared_count", cfg.n_shared_experts)
    w.add_float32(f"{a}.expert_weights_scale", cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_bool(f"{a}.expert_weights_norm", True)
    if cfg.topk_method != "greedy":
        w.add_uint32(f"{a}.expert_group_count", cfg.n_group)
        w.add_uint32(f"{a}.expert_group_used_count", cfg.topk_group)
    w.add_uint32(f"{a}.expert_gating_func", 2 if cfg.scoring_func == "sigmoid" else 1)
    w.add_uint32(f"{a}.rope.dimension_count", rope)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", scaling["factor"])
        w.add_uint32(f"{a}.rope.scaling.original_context_length", scaling["original_max_position_embeddings"])
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * scaling["mscale_all_dim"])


def _quantized(array: np.ndarray, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """``array`` in ``qtype`` blocks: quantized by gguf, or for a type gguf cannot quantize
    (the K-quants) random blocks of that type (kvserve.loader.synthetic), one matrix at a time."""
    try:
        return gguf.quants.quantize(array, qtype)
    except NotImplementedError:
        from kvserve.loader.synthetic import random_blocks
        rng = np.random.default_rng(seed)
        matrices = array.reshape(-1, *array.shape[-2:])
        blocks = np.stack([random_blocks(qtype, m.shape, rng) for m in matrices])
        return blocks.reshape(*array.shape[:-1], blocks.shape[-1])


def export_gguf(model, cfg, gguf_arch: str, path: Path, quantize: bool = False,
                extra_tensors: Optional[dict[str, np.ndarray]] = None, split_kv_b: bool = True,
                qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
                expert_type: Optional[gguf.GGMLQuantizationType] = None,
                metadata_overrides: Optional[dict[str, int]] = None) -> None:
    """Write ``model`` (a kvserve model of ``cfg``) as llama.cpp would (see the module);
    ``quantize``: every matrix in ``qtype`` (the expert stacks in ``expert_type``, where given),
    except what the converter keeps in float32 (the router, 1-D tensors);
    ``metadata_overrides``: uint32 keys written with other values (bad files)."""
    names = gguf.get_tensor_name_map(GGUF_ARCH_ENUMS[gguf_arch], cfg.num_hidden_layers)
    # (a Qwen3-MoE layer without experts, HF's mlp_only_layers, which gguf's qwen3moe tensor list
    # lacks: its dense MLP under llama's names)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    _metadata(w, cfg, gguf_arch, split_kv_b)
    for key, value in (metadata_overrides or {}).items():
        w.kv_data[0].pop(key, None)
        w.add_uint32(key, value)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    if scaling.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    for hf_name, array in _checkpoint_tensors(model, cfg, gguf_arch, split_kv_b).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None and ".mlp." in hf_name and ".experts." not in hf_name:
            name = dense_names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None and hf_name.endswith("e_score_correction_bias"):  # (gguf's map names its stem)
            name = names.get_name(hf_name[:-len("_bias")], try_suffixes=()) + ".bias"
        assert name is not None, hf_name
        if gguf_arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        if gguf_arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if gguf_arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0
        if quantize and array.ndim >= 2 and not name.endswith(_F32_TENSORS):
            kind = expert_type if expert_type is not None and "_exps." in name else qtype
            w.add_tensor(name, _quantized(array, kind, seed=len(name)), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

