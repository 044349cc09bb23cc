"""Configuration dataclasses. Validation raises ``ConfigError`` with a one-line reason."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvserve.config.kernels import KernelConfig, parse_kernel_config
from kvserve.config.speculative import SpeculativeConfig, parse_speculative_config
from kvserve.config.disagg import DisaggConfig
from kvserve.errors import ConfigError
from kvserve.kv_budget import parse_kv_cache_memory

__all__ = ["ConfigError", "ModelConfig", "CacheConfig", "SchedulerConfig", "EngineArgs", "KernelConfig",
           "SpeculativeConfig", "parse_speculative_config", "parse_kernel_config", "DEFAULT_MODEL", "KV_CACHE_DTYPES", "INT4_PREFILL_MODES"]


# How int4 mode computes prompt tokens (EngineArgs.int4_prefill): through bf16 copies of the
# block-quantized layers ("bf16"), through the blocks themselves ("blocks"), per layer the faster
# of those two here ("auto": kvserve.quant's DecodeFormatLinear.prefill_copy_pays), or
# through byte-code copies under int8 activations ("int8", opt-in: faster with AVX512-VNNI, the
# activations rounded; kvserve.quant.W8A8Linear). A GGUF read on its own blocks (quantization
# "gguf") keeps no copy: "int8" computes its prompt tokens on the blocks under int8 activations
# where AVX512-VNNI reads them (opt-in: ~1 point less top-1 agreement on long texts), the other
# modes under the decode rows' 16-bit ones.
INT4_PREFILL_MODES = ("auto", "bf16", "int8", "blocks")

@dataclass
class ModelConfig:
    """Architecture hyper-parameters, filled from GGUF metadata or an HF ``config.json``.

    Field names follow HF transformers' config names where one exists.
    """

    architecture: str  # a key of kvserve.models.registry.MODEL_CLASSES ("llama", "qwen3", "gemma3", ...)
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
    # Mixture of experts (qwen3_moe; 0 experts: a dense model). HF's names: the routed
    # experts' MLP width, how many experts each token takes, whether their weights are
    # renormalised to sum to 1, and which layers keep a dense MLP (``mlp_only_layers``, and
    # all but every ``decoder_sparse_step``-th).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    # DeepSeek's routing (models/routing.py; HF's names): "softmax" or "sigmoid" scores,
    # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3, with a per-expert score
    # correction bias) top-k over ``n_group`` expert groups of which ``topk_group`` are kept,
    # the routed weights times ``routed_scaling_factor``; ``n_shared_experts`` always-on
    # experts beside the routed ones (one MLP ``n_shared_experts`` times as wide).
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # Multi-head latent attention (DeepSeek V2/V3; ``kv_lora_rank`` 0: not MLA). HF's names:
    # the query's low-rank width (None: one full projection), the shared latent's width, the
    # per-head key parts without and with rope, the value head width, and whether the rope
    # dims rotate in adjacent pairs (HF's ``rope_interleave``; DeepSeek's own layout).
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def is_sliding(self, layer_idx: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_idx] == "sliding_attention"



@dataclass
class CacheConfig:
    block_size: int = 16
    # KV budget in bytes, or "auto" (what is free after the weights, kvserve.kv_budget); None
    # picks a small default from free memory.
    kv_cache_memory: Optional[Union[int, str]] = None
    # Explicit block count; overrides kv_cache_memory (tests use it to force preemption).
    num_gpu_blocks: Optional[int] = None
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        try:
            parse_kv_cache_memory(self.kv_cache_memory)
        except ValueError as e:
            raise ConfigError(str(e)) from None
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


DEFAULT_MODEL = "smollm2-135m-instruct"
# KV cache dtypes (kvserve.kv_cache maps them to storage): auto = bfloat16 when the linear
# weights are reduced, else the activation dtype; int8 = symmetric, a scale per token and head.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


@dataclass
class EngineArgs:
    """Everything a user can set on the engine (CLI flags and ``LLM(**kwargs)`` map onto it)."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: Optional[Union[int, str]] = None  # bytes, or "auto" (kvserve.kv_budget)
    num_blocks: Optional[int] = None  # overrides kv_cache_memory
    max_num_batched_tokens: int = 2048  # prefill tokens + decodes per step (chunk budget)
    max_num_seqs: int = 64
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Sliding-window layers keep their KV for the whole context instead of their own group
    # that gives back the blocks out of the window (the A/B baseline).
    disable_sliding_window_reclaim: bool = False
    max_waiting_requests: Optional[int] = None
    seed: int = 0
    num_threads: Optional[int] = None
    # Linear-layer weight format: None (same as dtype) | "bf16" | "int8" | "int4" (CPU).
    # With dtype "auto" on a CPU with fast bf16: float32 activations and bf16 weights.
    quantization: Optional[str] = None
    int4_prefill: str = "auto"  # one of INT4_PREFILL_MODES
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # Speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4}
    # (a dict or its JSON string); None: off. See kvserve/config/speculative.py for every key.
    speculative_config: Optional[Any] = None
    # Multi-step decoding (vLLM's --num-scheduler-steps): up to this many decode steps per
    # scheduling round while every running request decodes with sampling that needs nothing
    # from the step before (no logprobs, grammar, penalties or unmet min_tokens) and none
    # waits: the engine's per-step work is paid once per round, and a
    # stream's tokens arrive in bursts of up to this many. 1: a round per step. Single process,
    # without speculative decoding.
    num_scheduler_steps: int = 1
    # Run the model in a worker process even at 1 x 1 (the executor kvserve.executor.multiproc,
    # world size 1): the engine's own thread then only schedules and processes outputs.
    worker_process: bool = False
    # Async scheduling (vLLM's): the engine schedules and builds step N+1, and processes step
    # N-1's outputs, while the worker computes step N (kvserve/async_step.py). Implies a
    # worker process. Speculative decoding, tensor and pipeline parallelism keep the
    # synchronous step (a log line says so).
    async_scheduling: bool = False
    # Parallelism: one worker process per rank (kvserve.executor.multiproc); 1 x 1 runs the
    # model in the engine's process (unless worker_process or async_scheduling).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Bound on one step (and on every collective) of a parallel group: past it a worker is
    # taken as hung and the engine stops (seconds).
    distributed_timeout_s: float = 120.0
    # Which CPU kernels and numerics run (routes, batch invariance, step teams, collectives):
    # a KernelConfig or a dict of its fields (kvserve/config/kernels.py); resolved at start-up.
    kernel_config: Any = field(default_factory=KernelConfig)
    # Prefill/decode disaggregation: this engine's role (prefill or decode) and KV connector
    # (kvserve.config.disagg.DisaggConfig); None: an ordinary, colocated engine.
    kv_transfer: Optional[DisaggConfig] = None

    def cache_config(self) -> CacheConfig:
        cfg = CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                          num_gpu_blocks=self.num_blocks,
                          enable_prefix_caching=self.enable_prefix_caching)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ConfigError(f"unknown dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if self.quantization not in (None, "none", "gguf", "bf16", "int8", "int4"):
            raise ConfigError(f"unknown quantization {self.quantization!r}; use gguf, bf16, int8 or int4")
        if self.int4_prefill not in INT4_PREFILL_MODES:
            raise ConfigError(f"unknown int4_prefill {self.int4_prefill!r}; use one of {', '.join(INT4_PREFILL_MODES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads must be >= 1")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ConfigError("max_waiting_requests must be >= 0")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.distributed_timeout_s <= 0:
            raise ConfigError("distributed_timeout_s must be positive")
        if self.num_scheduler_steps < 1:
            raise ConfigError("num_scheduler_steps must be >= 1")
        self.cache_config()
        parse_speculative_config(self.speculative_config)
        self.kernel_config = parse_kernel_config(self.kernel_config)
        SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs).validate()
        if self.kv_transfer is not None:
            self.kv_transfer.validate()
            if self.async_scheduling or self.worker_process:
                raise ConfigError("disaggregated prefill/decode runs the model in the engine's process: "
                                  "it cannot be combined with async scheduling or a worker process")
            if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
                raise ConfigError("disaggregated prefill/decode runs the model in the engine's process: "
                                  "it cannot be combined with tensor or pipeline parallelism")
            if self.speculative_config is not None:
                raise ConfigError("disaggregated prefill/decode does not support speculative decoding yet")
