"""DeepSeek V3 (and its V3-shaped distillations, Kimi-K2's layout): DeepSeek V2's decoder
(models/deepseek_v2.py: MLA on the latent cache, routed and shared experts, dense first
layers) with V3's routing and rope options.

- Routing is always "noaux_tc" (HF's DeepseekV3TopkRouter, whatever the config's
  ``topk_method`` / ``scoring_func`` say): sigmoid scores; experts chosen by score plus the
  per-expert ``e_score_correction_bias`` (``mlp.gate.e_score_correction_bias``) within the
  ``topk_group`` of ``n_group`` groups whose two best biased scores sum highest; weighted by
  the unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
- ``rope_interleave`` (default True) chooses DeepSeek's pairwise rope layout or the halves.
- ``q_lora_rank`` is set in every released V3 (the query's low-rank bottleneck).
"""
from __future__ import annotations

import re
from typing import Any

from kvserve.config import ModelConfig
from kvserve.models.deepseek_v2 import (
    DeepseekV2ForCausalLM, adapt_mla_config, adapt_moe_config, check_deepseek_config,
)

ARCHITECTURE = "deepseek_v3"
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """V3 checkpoints hold ``num_nextn_predict_layers`` multi-token-prediction layers after
        the decoder's (``model.layers.<num_hidden_layers>.``...), for speculative decoding, which
        plain decoding never runs (HF skips them too)."""
        m = _LAYER_INDEX.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_hidden_layers

    @classmethod
    def adapt_hf_config(cls, hf_config: dict[str, Any], config: ModelConfig) -> None:
        adapt_mla_config(hf_config, config)
        adapt_moe_config(hf_config, config)
        config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
        config.rope_interleave = bool(hf_config.get("rope_interleave", True))
        check_deepseek_config(config)


def tiny_config() -> ModelConfig:
    """A random-weight DeepSeek-V3-shaped test model on SmolLM2's vocabulary: a query
    bottleneck (``q_lora_rank`` 48), a 32-wide latent with a 16-dim rope key, values 24 wide
    (not the keys' 16), YaRN rope stretched 4x from a 1024-token original context (its
    lower frequencies interpolated, cos/sin and the softmax scale rescaled), 8 experts in 4 groups of which 2 compete (noaux_tc), top 2
    renormalised and scaled by 2.5, one shared expert, the first of 3 layers dense."""
    return ModelConfig(
        architecture=ARCHITECTURE, vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2], name="tiny-deepseek-v3",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
        norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, n_shared_experts=1, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
    )
