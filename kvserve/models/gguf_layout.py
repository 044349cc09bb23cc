"""How llama.cpp's converter (convert_hf_to_gguf.py) writes an architecture into a GGUF file,
as each architecture's module declares it (``GGUF_LAYOUTS`` in models/<arch>.py, collected by
models/registry.py; read by loader/gguf.py): the per-block tensor names and the HF parameter
each holds, and a hook for the metadata only that architecture writes.

What files change relative to the HF checkpoint, undone by the loader:
- ``permuted_qk`` (llama): the rows of ``attn_q`` / ``attn_k`` are permuted, per head, for
  llama.cpp's rope layout. Other architectures' rope (NEOX, or DeepSeek's adjacent pairs) reads
  HF's rows as they are.
- ``norms_plus_one`` (gemma3): every norm is stored as ``1 + w``.
- ``expert_names`` (MoE): each layer's routed experts are stacked into 3-D tensors
  ``ffn_{gate,up,down}_exps`` ``[experts, out, in]``; expert ``e``'s HF matrix is slice ``e`` (in
  a block format, a whole number of rows of blocks: read in place like a 2-D tensor).
- ``kv_b_split`` (deepseek2): newer files split ``kv_b_proj`` into ``attn_k_b`` (each head's key
  half, transposed: ``[heads, kv_lora_rank, qk_nope_head_dim]``) and ``attn_v_b`` (``[heads,
  v_head_dim, kv_lora_rank]``) for llama.cpp's absorbed attention; older files keep ``attn_kv_b``.
- ``config_tensors``: tensors that are hyper-parameters (rope frequency factors), read by
  ``adapt`` into the config rather than loaded as weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from kvserve.config import ConfigError, ModelConfig


class GGUFMetadata(Protocol):
    """What an architecture's hook reads of a file (the loader's view of it)."""

    path: str

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        """``<general.architecture>.<key>`` (``required``: ConfigError when absent)."""

    def has_tensor(self, name: str) -> bool: ...

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Row-major shape (``[out, in]`` for a matrix, ``[experts, out, in]`` for a stack)."""

    def tensor_floats(self, name: str) -> list[float]:
        """A small tensor's values (rope factors)."""


@dataclass(frozen=True)
class GGUFLayout:
    gguf_architecture: str  # general.architecture
    architecture: str  # kvserve's (ModelConfig.architecture; ``adapt`` may refine it)
    block_names: dict[str, str]  # blk.N.<name> -> the HF module under model.layers.N. (or
    #                              "<name>.<suffix>" -> the HF parameter, for one without the usual suffix)
    permuted_qk: bool = False
    norms_plus_one: bool = False
    expert_names: dict[str, str] = field(default_factory=dict)  # 3-D stacks -> expert "{e}"'s HF module
    kv_b_split: Optional[tuple[str, str]] = None  # (key halves, value halves) read as one kv_b_proj
    rope_by_adapt: bool = False  # ``adapt`` reads the rope settings (dims, scaling), not the generic reader
    config_tensors: frozenset[str] = frozenset()
    # The architecture's own metadata onto the generic config (in place; ConfigError for what
    # kvserve cannot run).
    adapt: Optional[Callable[[GGUFMetadata, ModelConfig], None]] = None


LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Routed experts' stacks, and their router (``ffn_gate_inp``, which llama.cpp keeps in F32).
EXPERT_STACK_NAMES = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
ROUTER_NAMES = {"ffn_gate_inp": "mlp.gate"}
# llama.cpp's llama3 rope: per-frequency divisors, stored as a tensor rather than metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def moe_layers(meta: GGUFMetadata, num_layers: int) -> list[int]:
    """The layers that route (have a router tensor)."""
    return [i for i in range(num_layers) if meta.has_tensor(f"blk.{i}.ffn_gate_inp.weight")]


def check_expert_stacks(meta: GGUFMetadata, config: ModelConfig) -> None:
    """Every expert stack holds ``num_experts`` matrices of the declared width."""
    want = {"ffn_gate_exps": (config.num_experts, config.moe_intermediate_size, config.hidden_size),
            "ffn_up_exps": (config.num_experts, config.moe_intermediate_size, config.hidden_size),
            "ffn_down_exps": (config.num_experts, config.hidden_size, config.moe_intermediate_size)}
    for i in range(config.num_hidden_layers):
        for tensor, shape in want.items():
            name = f"blk.{i}.{tensor}.weight"
            if meta.has_tensor(name) and tuple(meta.tensor_shape(name)) != shape:
                raise ConfigError(f"{meta.path}: {name} has shape {tuple(meta.tensor_shape(name))}, the "
                                  f"metadata describes {shape} (experts, rows, columns)")
