"""What an architecture declares about its decoder layer, for the native fused decoder.

The native loop (kvserve/csrc/decoder.cpp, driven by models/fused.py) runs one fixed layer
skeleton with optional parts: per-head q/k norms, norms after attention and after the MLP,
attention logit softcaps, a second rope table for sliding layers, routed experts in place of
the MLP. Each architecture's model class says which parts it has (``layer_spec``), and which
of its modules hold them, instead of fused.py guessing from attribute names: an architecture
the skeleton does not fit says so (``native=False``) and runs layer by layer, never silently
mis-assembled.

Torch-free: a description, read by the loader and fused.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DecoderLayerSpec:
    # RMSNorm weight offset of every norm in the layer (and the final norm): 0.0 -> ``x * w``
    # (LLaMA, Qwen3, Phi-3), 1.0 -> ``x * (1 + w)`` (Gemma). Per architecture, so that Qwen3's
    # q/k norms and Gemma 3's, which the native loop runs alike, each get their own.
    norm_offset: float = 0.0
    # Per-head RMSNorm of q and k before rope (``self_attn.q_norm`` / ``self_attn.k_norm``).
    qk_norm: bool = False
    # The layer's module names for the norm before the MLP, and the optional norms applied
    # to the attention output and the MLP output before each residual add (Gemma's sandwich).
    pre_ffn_norm: str = "post_attention_layernorm"
    post_attn_norm: Optional[str] = None
    post_ffn_norm: Optional[str] = None
    # Sliding layers read their own rope table (Gemma 3's local base frequency).
    local_rope: bool = False
    # "gated": one gate+up projection, an activation, a down projection. "moe": routed experts
    # on the layers the config says (``ModelConfig.is_moe_layer``; the others gated), by the
    # rule ``routing`` names: the native loop runs "softmax_top_k" (Qwen3-MoE: softmax, top k,
    # optional renormalisation; models/routing.py), not DeepSeek's grouped rules and shared
    # experts (such a model runs layer by layer).
    mlp: str = "gated"
    routing: Optional[str] = None
    # "mha": per-head q/k/v (grouped or not) on the per-head KV cache. "mla": DeepSeek's
    # multi-head latent attention on the latent cache, which the native loop does not run.
    attention: str = "mha"

    @property
    def native(self) -> bool:
        """Whether the native decoder's skeleton can run this layer at all."""
        mlp_native = self.mlp == "gated" or (self.mlp == "moe" and self.routing in NATIVE_ROUTINGS)
        return mlp_native and self.attention == "mha"


# The routing rules the native decoder's routed experts run (csrc/moe_routing.cpp).
NATIVE_ROUTINGS = ("softmax_top_k",)


LLAMA_LAYER = DecoderLayerSpec()
