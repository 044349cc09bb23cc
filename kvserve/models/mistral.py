"""Mistral: the LLaMA decoder with one sliding window on every layer (``sliding_window`` in
the config; None in Mistral v0.2+ and Nemo, which attend globally). The windowed layers form
sliding-window KV groups (kvserve.kv_cache), so the blocks a request's window has passed are
given back while it runs."""
from __future__ import annotations

from typing import Any

from kvserve.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM

ARCHITECTURE = "mistral"


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def adapt_hf_config(cls, hf_config: dict[str, Any], config: ModelConfig) -> None:
        if hf_config.get("sliding_window"):
            config.sliding_window = int(hf_config["sliding_window"])
            config.layer_types = ["sliding_attention"] * config.num_hidden_layers


def tiny_config() -> ModelConfig:
    """A random-weight test model whose window (24 tokens: one block and a half) is shorter
    than the test prompts, so that the window really slides, mid-block."""
    return ModelConfig(
        architecture=ARCHITECTURE, vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
        sliding_window=24, layer_types=["sliding_attention"] * 2,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], name="tiny-mistral-swa",
    )
