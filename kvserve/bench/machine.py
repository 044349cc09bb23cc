"""The machine's own limits (a plain matmul, a large read) and the FLOPs a model run needed.

A decode or prefill figure means little on its own on a shared, noisy machine; as a fraction
of what ``torch.matmul`` reaches in the same run it says how much headroom is left.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from kvserve.bench.memory_bandwidth import measure_read_bandwidth
from kvserve.config import ModelConfig
from kvserve.cpu_features import CPU_FEATURES, cpu_info  # noqa: F401 (re-exported for benchmarks)


def matmul_gflops(dtype: torch.dtype, size: int = 1024, seconds: float = 1.0,
                  device: str = "cpu") -> float:
    """Sustained GFLOP/s of a square ``size`` matmul at the current torch thread count."""
    dev = torch.device(device)
    a = torch.randn(size, size, dtype=dtype, device=dev)
    b = torch.randn(size, size, dtype=dtype, device=dev)
    out = torch.empty(size, size, dtype=dtype, device=dev)
    for _ in range(2):  # first calls pick kernels and warm caches
        torch.matmul(a, b, out=out)
    _sync(dev)
    n = 0
    t0 = time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        n += 1
        if n % 4 == 0:
            _sync(dev)
            if time.perf_counter() - t0 >= seconds:
                break
    elapsed = time.perf_counter() - t0
    return 2.0 * size ** 3 * n / elapsed / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_routes() -> dict:
    """Which of kvserve's routes this process's kernels take (they differ in speed and in the
    last bits): the bf16 linear layers' (amx, dot, widened512, widened256, portable) and
    attention's over a bf16 cache (amx, dot, widened)."""
    from kvserve import ops

    ext = ops.load_extension()
    if ext is None:
        return {}
    return {"bf16": ext.bf16_kernel_route(), "attention": ext.attention_kernel_route()}


def machine_limit(size: int = 1024, seconds: float = 1.0, device: str = "cpu",
                  read_bandwidth: bool = False) -> dict:
    """The matmul limit, and with ``read_bandwidth`` (CPU only) the memory's read limit."""
    return {
        "cpu": cpu_info(),
        "kernel_routes": kernel_routes() if device == "cpu" else {},
        "matmul_size": size,
        "num_threads": torch.get_num_threads(),
        "gflops": {"bfloat16": matmul_gflops(torch.bfloat16, size, seconds, device),
                   "float32": matmul_gflops(torch.float32, size, seconds, device)},
        # The memory's limit beside the arithmetic's: batch-1 decode is bound by its reads.
        "read_bandwidth": measure_read_bandwidth().to_dict() if read_bandwidth and device == "cpu" else None,
    }


def machine_load() -> Optional[dict]:
    """1-minute load average against the core count: other work on the machine skews every
    figure (torch's thread pool suffers more from it than llama.cpp's)."""
    try:
        load1 = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
    return {"load_1min": load1, "cpu_count": os.cpu_count()}


def _mla_params(cfg: ModelConfig) -> int:
    """An MLA layer's weights per token: the query (through its bottleneck where it has one),
    the latent and rope key, ``kv_b_proj`` (a prefill token expands its latent through it;
    a decode token's absorbed query and latent output pass through its two halves instead:
    the same count), the output projection."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_width = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q = h * q_width if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + q_width)
    latent = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    up = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + latent + up + heads * cfg.v_head_dim * h


@dataclass(frozen=True)
class ModelFlops:
    """Matmul weights of a decoder: the ones every token multiplies (the non-embedding
    parameters) and the LM head, which only sampled positions need."""

    non_embedding_params: int
    lm_head_params: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "ModelFlops":
        # Counted from the architecture, not from module parameters, so quantized or fused
        # weight layouts count the same. Norm weights are negligible and left out.
        h, hd = cfg.hidden_size, cfg.head_dim
        attn = _mla_params(cfg) if cfg.uses_mla else (h * cfg.num_attention_heads * hd * 2
                                                       + h * cfg.num_key_value_heads * hd * 2)
        mlp = 3 * h * cfg.intermediate_size  # gate, up, down (SwiGLU and GeGLU alike)
        # A mixture-of-experts layer: the router, the experts a token is routed to and the
        # shared experts every token runs (DeepSeek).
        moe = h * cfg.num_experts + 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok
                                                                          + cfg.n_shared_experts)
        mlps = sum(moe if cfg.is_moe_layer(i) else mlp for i in range(cfg.num_hidden_layers))
        return cls(cfg.num_hidden_layers * attn + mlps, cfg.vocab_size * h)

    def flops(self, computed_tokens: int, sampled_tokens: int) -> float:
        """2 x weights x tokens (one multiply-add per weight per token); attention scores
        are left out, so this is a floor on the work done."""
        return 2.0 * (self.non_embedding_params * computed_tokens
                      + self.lm_head_params * sampled_tokens)


def achieved(flops: float, elapsed_s: float, limit: dict, dtype: torch.dtype) -> dict:
    """Achieved GFLOP/s and its fraction of the matmul limit in the engine's dtype and of the
    machine's best dtype."""
    gflops = flops / max(elapsed_s, 1e-9) / 1e9
    by_dtype = limit["gflops"]
    own = by_dtype.get(str(dtype).removeprefix("torch."))
    best = max(by_dtype.values())
    return {"gflop": flops / 1e9, "achieved_gflops": gflops,
            "fraction_of_matmul_limit_same_dtype": gflops / own if own else None,
            "fraction_of_best_matmul_limit": gflops / best if best else None}
