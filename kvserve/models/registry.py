"""Architecture name (``ModelConfig.architecture``) -> model class."""
from __future__ import annotations

from kvserve.config import ConfigError
from kvserve.models import deepseek_v2, gemma3, llama, phi3, qwen3, qwen3_moe
from kvserve.models.base import PagedCausalLM
from kvserve.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.gguf_layout import GGUFLayout
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


# GGUF general.architecture -> how llama.cpp writes it (each module's GGUF_LAYOUTS; DeepSeek V2
# and V3 share "deepseek2", Mistral files are "llama").
GGUF_LAYOUTS: dict[str, GGUFLayout] = {
    layout.gguf_architecture: layout
    for module in (llama, qwen3, qwen3_moe, phi3, gemma3, deepseek_v2) for layout in module.GGUF_LAYOUTS
}


def get_gguf_layout(gguf_architecture: str, path: str = "") -> GGUFLayout:
    """The layout of a GGUF file's ``general.architecture`` (ConfigError naming the file, ``path``)."""
    if gguf_architecture not in GGUF_LAYOUTS:
        raise ConfigError(f"{path}: unsupported architecture '{gguf_architecture}' "
                          f"(supported: {', '.join(sorted(GGUF_LAYOUTS))})")
    return GGUF_LAYOUTS[gguf_architecture]
