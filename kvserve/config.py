"""Configuration dataclasses. Validation raises ``ConfigError`` with a one-line reason."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A user-facing configuration problem (bad model path, bad engine argument...)."""


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, filled from GGUF metadata or an HF ``config.json``.

    Field names follow HF transformers' config names where one exists.
    """

    architecture: str  # "llama" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Gemma 3: rope base of the sliding-window (local) layers.
    rope_local_base_freq: Optional[float] = None
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Sliding-window attention: window size in tokens (a query attends to itself and the
    # window-1 tokens before it), and per layer whether that layer is windowed.
    sliding_window: Optional[int] = None
    layer_types: Optional[list[str]] = None  # "sliding_attention" | "full_attention" per layer
    query_pre_attn_scalar: Optional[float] = None  # gemma3: attention scale = this ** -0.5
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""

    def is_sliding(self, layer_idx: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_idx] == "sliding_attention"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes, the seeds' formula."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass
class CacheConfig:
    block_size: int = 16
    # KV budget in bytes; None picks a default from free memory (see kv sizing in the engine).
    kv_cache_memory: Optional[int] = None
    # Explicit block count; overrides kv_cache_memory (tests use it to force preemption).
    num_gpu_blocks: Optional[int] = None
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_gpu_blocks}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: Optional[int] = None  # None: the model's context length
    # Long prompts are split into chunks that fit the per-step token budget.
    enable_chunked_prefill: bool = True
    max_waiting_requests: Optional[int] = None

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
