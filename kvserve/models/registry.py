"""Architecture name (``ModelConfig.architecture``) -> model class."""
from __future__ import annotations

from kvserve.config import ConfigError
from kvserve.models.base import PagedCausalLM
from kvserve.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.mistral import MistralForCausalLM
from kvserve.models.phi3 import Phi3ForCausalLM
from kvserve.models.qwen3 import Qwen3ForCausalLM
from kvserve.models.qwen3_moe import Qwen3MoeForCausalLM

# One line per architecture: its module (kvserve/models/<arch>.py) owns the rest (HF config
# mapping, native layer spec, tiny test config, tensor-parallel parts).
MODEL_CLASSES: dict[str, type[PagedCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}


def get_model_class(architecture: str) -> type[PagedCausalLM]:
    if architecture not in MODEL_CLASSES:
        raise ConfigError(
            f"unsupported architecture '{architecture}' (supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    return MODEL_CLASSES[architecture]
