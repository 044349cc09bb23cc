"""Phi-3 / Phi-3.5 / Phi-4-mini: the LLaMA decoder whose checkpoints store the fused
projections themselves (``self_attn.qkv_proj``: q, k, v rows in that order; ``mlp.gate_up_proj``:
gate rows, then up rows), no biases, an optional uniform sliding window, and LongRoPE rope
scaling (``longrope``: per-frequency short and long factors and an attention factor) in the
128k-context variants.

HF's parameter names are kvserve's fused names already: nothing is concatenated at load
(``packed_modules`` is empty), and tensor parallelism cuts each fused checkpoint tensor into
its parts before sharding them (``fused_checkpoint_parts``, read by models/tensor_parallel.py).
"""
from __future__ import annotations

from typing import Any, ClassVar

from kvserve.config import ConfigError, ModelConfig
from kvserve.models.gguf_layout import GGUFLayout, GGUFMetadata
from kvserve.models.llama import LlamaForCausalLM

ARCHITECTURE = "phi3"


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {}
    # The fused tensors of the checkpoint and the parts they hold, in row order.
    fused_checkpoint_parts: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    @classmethod
    def adapt_hf_config(cls, hf_config: dict[str, Any], config: ModelConfig) -> None:
        params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
        partial = float(params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise ConfigError(f"phi3: partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
        # Every layer is windowed when the config names a window (HF's Phi3 masks them all
        # alike); the 128k variants name one (262144) past their context: no window at all.
        window = hf_config.get("sliding_window")
        if window and window < config.max_position_embeddings:
            config.sliding_window = int(hf_config["sliding_window"])
            config.layer_types = ["sliding_attention"] * config.num_hidden_layers
        scaling = config.rope_scaling
        if scaling is not None and scaling.get("rope_type") == "longrope":
            scaling.setdefault("original_max_position_embeddings",
                               int(hf_config.get("original_max_position_embeddings", config.max_position_embeddings)))
            half = config.head_dim // 2
            for key in ("short_factor", "long_factor"):
                if len(scaling.get(key) or ()) != half:
                    raise ConfigError(f"phi3: longrope {key} must have {half} entries")


def tiny_config() -> ModelConfig:
    """A random-weight test model on SmolLM2's vocabulary (its tokenizer drives it)."""
    return ModelConfig(
        architecture=ARCHITECTURE, vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2], name="tiny-phi3",
    )


def adapt_gguf_config(meta: GGUFMetadata, config: ModelConfig) -> None:
    """Phi-3 from a GGUF file: a window only where it is shorter than the context (as from HF's
    config; Phi-4 files write 0); the 128k variants' LongRoPE from the factor tensors
    ``rope_factors_long`` / ``rope_factors_short`` and the metadata's original context and
    attention factor (llama.cpp chooses the long factors by the context it is given; kvserve,
    as HF, by each sequence's length)."""
    window = config.sliding_window
    if window and window >= config.max_position_embeddings:
        config.sliding_window, config.layer_types = None, None
    names = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
    present = [meta.has_tensor(name) for name in names.values()]
    if not any(present):
        return
    if not all(present):
        raise ConfigError(f"{meta.path}: LongRoPE needs both rope_factors_long and rope_factors_short")
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for key, name in names.items():
        scaling[key] = meta.tensor_floats(name)
    scaling["original_max_position_embeddings"] = int(meta.get("rope.scaling.original_context_length", required=True))
    attn_factor = meta.get("rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    half = config.head_dim // 2
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != half:
            raise ConfigError(f"{meta.path}: {names[key]} has {len(scaling[key])} entries, expected {half}")
    config.rope_scaling = scaling


# GGUF: llama.cpp keeps the checkpoint's fused tensors, q/k/v rows in ``attn_qkv`` and gate then
# up rows in ``ffn_up`` (its SwiGLU takes the first half as the gate): kvserve holds them fused
# under HF's names, so they load as they are.
GGUF_LAYOUTS = (GGUFLayout("phi3", ARCHITECTURE, {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}, config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}), adapt=adapt_gguf_config),)
