"""Model implementations on the paged KV cache. All share one forward signature (see
``PagedCausalLM.forward``) and upstream (HF) parameter names."""
from kvserve.models.base import PagedCausalLM
from kvserve.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.mistral import MistralForCausalLM
from kvserve.models.phi3 import Phi3ForCausalLM
from kvserve.models.qwen3 import Qwen3ForCausalLM
from kvserve.models.qwen3_moe import Qwen3MoeForCausalLM
from kvserve.models.registry import MODEL_CLASSES, get_model_class

__all__ = ["PagedCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
           "Phi3ForCausalLM", "Gemma3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
           "MODEL_CLASSES", "get_model_class"]
