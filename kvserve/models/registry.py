"""Architecture name (``ModelConfig.architecture``) -> model class."""
from __future__ import annotations

from torch import nn

from kvserve.config import ConfigError
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_CLASSES:
        raise ConfigError(
            f"unsupported architecture '{architecture}' (supported: {', '.join(sorted(MODEL_CLASSES))})"
        )
    return MODEL_CLASSES[architecture]
