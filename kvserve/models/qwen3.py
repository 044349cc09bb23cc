"""Qwen3 (dense): the LLaMA decoder with a per-head RMSNorm of q and k before rope (QK-norm,
plain ``x * w`` norms, unlike Gemma's ``x * (1 + w)``), no q/k/v bias by default, and a
head dimension set in the config rather than ``hidden / heads`` (128 in every size).

Parameter names are HF's ``Qwen3ForCausalLM``'s (``self_attn.q_norm`` / ``self_attn.k_norm``)
except the fused ``qkv_proj`` / ``gate_up_proj``, as in llama.py.
"""
from __future__ import annotations

from typing import Any

import torch

from kvserve import ops
from kvserve.config import ModelConfig
from kvserve.models.gguf_layout import LLAMA_BLOCK_NAMES, QK_NORM_NAMES, GGUFLayout
from kvserve.models.layers import RMSNorm
from kvserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from kvserve.models.spec import DecoderLayerSpec

ARCHITECTURE = "qwen3"


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def norm_and_rope_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        # The kernel Gemma 3's QK-norm runs, with this architecture's norm offset (0: x * w).
        ops.rope_qk_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, norm_offset=RMSNorm.offset)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
    layer_spec = DecoderLayerSpec(norm_offset=RMSNorm.offset, qk_norm=True)

    @classmethod
    def adapt_hf_config(cls, hf_config: dict[str, Any], config: ModelConfig) -> None:
        # Qwen3's o_proj carries a bias exactly when q/k/v do (Qwen2's never does): LlamaAttention
        # reads that from attention_bias and the architecture name. Sliding windows (off in every
        # released Qwen3) come from use_sliding_window / max_window_layers, as Qwen2's.
        config.attention_bias = bool(hf_config.get("attention_bias", False))


def tiny_config() -> ModelConfig:
    """A random-weight test model: SmolLM2's vocabulary (its tokenizer drives it), a head
    dimension (32) that is not hidden / heads (16), as in real Qwen3 models."""
    return ModelConfig(
        architecture=ARCHITECTURE, vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu",
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], name="tiny-qwen3",
    )


GGUF_LAYOUTS = (GGUFLayout("qwen3", ARCHITECTURE, {**LLAMA_BLOCK_NAMES, **QK_NORM_NAMES}),)
