"""Model implementations on the paged KV cache. All share one forward signature (see
``PagedCausalLM.forward``) and upstream (HF) parameter names."""
from kvserve.models.base import PagedCausalLM
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.registry import MODEL_CLASSES, get_model_class

__all__ = ["PagedCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM", "MODEL_CLASSES", "get_model_class"]
