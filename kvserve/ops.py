"""Fused CPU kernels (``kvserve/csrc/``: norm_rope, kv_write, attention, sampling ...) and their
plain-torch twins.

A decode step of a small model is hundreds of tiny ops per layer; in plain torch each costs
a few microseconds of dispatch, more than its arithmetic. The C++ kernels do a whole norm,
rotary embedding, KV-cache write, the step's paged attention (prefill chunks and decodes,
reading blocks in place, no gathered copy) or gated activation in one call. They are compiled on first use with
``torch.utils.cpp_extension`` (cached in ``<venv>/kvserve-build``; ``scripts/setup.sh``
builds them) and used only for fp32 activations on the CPU. Anything else, a machine without
a compiler, or ``KernelConfig(native_kernels=False)`` takes the torch reference below (for the cache write and
attention, in kvserve.kv_cache and kvserve.attention), which the tests use as the
ground truth for the kernels. Which routes the kernels take (and whether rows must be
batch-invariant) is the engine's ``KernelConfig``, put in force by ``apply_kernel_config``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.config.kernels import KernelConfig
from kvserve.cpu_features import has_feature
from kvserve.errors import ConfigError

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("norm_rope.cpp", "kv_write.cpp", "attention.cpp", "attention_int8.cpp", "sampling.cpp", "bindings.cpp", "quant_linear.cpp", "screen_linear.cpp", "dense_linear.cpp", "amx_linear.cpp", "w8a8_linear.cpp", "decoder.cpp", "step_team.cpp", "block_repack.cpp", "moe_routing.cpp")]
ACTIVATION_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}
_ext: Any = None
_load_attempted = False
_kernels_on = True
# The kernel configuration in force (apply_kernel_config): the defaults until an engine applies one.
_applied: Optional[KernelConfig] = None
_native_allowed = True
_batch_invariant = True
_march = "native"
_amx_warned = False


def load_extension() -> Optional[Any]:
    """The compiled module, building it the first time; None where the kernel configuration in
    force says plain torch (``KernelConfig.native_kernels``) or it cannot be built."""
    global _ext, _load_attempted
    if not _native_allowed:
        return None
    if _load_attempted:
        return _ext
    _load_attempted = True
    try:
        from torch.utils.cpp_extension import load

        suffix = "" if _march == "native" else "_" + re.sub(r"[^0-9A-Za-z]", "_", _march)
        _ext = load(
            build_directory=_build_directory(suffix),
            name="kvserve_cpu_ops" + suffix,
            sources=[str(path) for path in _SOURCES],
            # Reassociation lets the vectorised dot products reduce their lanes as a tree;
            # without it GCC adds the 16 lanes one by one (measured 3x slower attention).
            # KernelConfig.cpu_march (e.g. znver3, x86-64-v2) builds another CPU's route on this
            # one, to test it, in a build directory of its own.
            extra_cflags=["-O3", f"-march={_march}", "-fopenmp", "-fopenmp-simd",
                          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: run on the torch path
        logger.warning("fused CPU kernels unavailable (%s); using the plain-torch path", exc)
        _ext = None
        return _ext
    # Settle the bf16 route now, while the process is small: on a CPU with AMX that runs the
    # tiles' self-test in a forked child.
    _ext.bf16_kernel_route()
    return _ext


def apply_kernel_config(config: KernelConfig) -> KernelConfig:
    """Put ``config`` in force for this process's kernels and return it resolved: ``auto``
    routes replaced by the routes the kernels take here, ``native_kernels`` False where they
    cannot be built. An engine applies its configuration at start-up and again before each
    step (nothing to do while it is still the one in force), so two engines in one process may
    differ. Raises ConfigError for a route the machine cannot run (``amx`` without usable
    tiles) or a ``cpu_march`` other than the one this process built its kernels for."""
    global _applied, _native_allowed, _batch_invariant, _march
    if config is _applied:
        return config
    if _load_attempted and _ext is not None and config.native_kernels and config.cpu_march != _march:
        raise ConfigError(f"cpu_march {config.cpu_march!r}: this process built its kernels for {_march!r} "
                          "(one build per process)")
    _native_allowed, _batch_invariant = config.native_kernels, config.batch_invariant
    if config.native_kernels:
        _march = config.cpu_march
    ext = load_extension()
    if ext is None:
        resolved = dataclasses.replace(config, native_kernels=False)
    else:
        ext.set_step_teams(config.step_teams)
        try:
            ext.set_bf16_kernel_route(config.bf16_route)
            ext.set_attention_kernel_route(config.attention_route)
        except RuntimeError as exc:
            raise ConfigError(f"kernel configuration: {exc}".splitlines()[0]) from None
        resolved = dataclasses.replace(config, bf16_route=ext.bf16_kernel_route(),
                                       attention_route=ext.attention_kernel_route())
        if (has_feature("amx_bf16") and resolved.bf16_route != "amx" and config.bf16_route == "auto"
                and not _amx_warned):
            _warn_amx_unused(ext)
    _applied = resolved
    return resolved


def _warn_amx_unused(ext: Any) -> None:
    """A CPU that lists AMX but whose tiles cannot run (the OS, the kernel's permission, the
    self-test) is said once, with the reason, since its bits and speed are then the vector
    route's."""
    global _amx_warned
    _amx_warned = True
    logger.warning("the CPU lists AMX but bf16 layers take the %s route: %s", ext.bf16_kernel_route(),
                   ext.amx_bf16_status())


def applied_kernel_config() -> Optional[KernelConfig]:
    """The resolved kernel configuration in force; None before any engine applied one."""
    return _applied


def batch_invariant() -> bool:
    """Whether every row's bits must not depend on the batch (KernelConfig.batch_invariant of the
    configuration in force; True before any engine applied one)."""
    return _batch_invariant


def _build_directory(suffix: str = "") -> Optional[str]:
    """Per environment (``<venv>/kvserve-build``): the binary belongs to that environment's
    torch, and two checkouts sharing ``~/.cache/torch_extensions`` would rebuild each other's.
    None (torch's default) where the environment is read-only or ``TORCH_EXTENSIONS_DIR``
    says where to build (torch's own variable)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    path = Path(sys.prefix) / "kvserve-build" / ("cpu_ops" + suffix)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(path) if os.access(path, os.W_OK) else None


def cpu_extension() -> Optional[Any]:
    """The compiled module unless disabled (``use_kernels(False)``, ``KernelConfig.native_kernels``) or
    unbuildable; for callers that check their tensors themselves."""
    return load_extension() if _kernels_on else None


def int8_prompt_kernels() -> bool:
    """Whether the tile kernels' int8 prompt path (csrc/quant_linear.cpp's PromptActivations) is
    built here: AVX512 with VNNI; elsewhere prompt rows keep the split 16-bit activations."""
    ext = load_extension()
    return ext is not None and ext.int8_prompt_kernels()


def nibble_kernel_isa() -> str:
    """Which route the block-format kernels (csrc/quant_linear.cpp) were built with here:
    "avx512" (AVX512-BF16), "avx2" (AVX2 + FMA) or "portable"; "none" without the extension."""
    ext = load_extension()
    return "none" if ext is None else ext.quant_kernel_isa()


ACTIVATION_LEVELS = 32639.0  # csrc/quant_linear.cpp's kActivationLevels (127 * 256 + 127)


def nibble_kernel_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32 [rows, K]) as the nibble-format kernels (Q4_1, Q4_K, Q5_0) read it here:
    on AVX512 and AVX2 per group of 32 inputs to 16-bit integers times the group's scale
    ``max|x| / 32639`` (csrc/quant_linear.cpp's kActivationLevels, the same fp32 operations and
    rounding); rounded to bf16 by the portable loops and where no extension is built. The
    plain-torch path rounds as this machine's kernels do even inside ``use_kernels(False)``:
    it is the reference the kernels are checked against, and bf16 rounding there (2^-9 of each
    input, against the kernels' 2^-16 of the group's largest) put ~0.3 % per layer of its own
    error into that comparison (1 % after Gemma 3's 18 layers)."""
    ext = load_extension()
    if ext is None or ext.nibble_activation_format() != "int16":
        return x.to(torch.bfloat16).float()
    rows, k = x.shape
    groups = torch.nn.functional.pad(x, (0, -k % 32)).view(rows, -1, 32)
    largest = groups.abs().amax(-1, keepdim=True)
    finite = (largest > 0) & torch.isfinite(largest)
    # (tensor / tensor: a number over a tensor is computed as its reciprocal's product, 1 ulp off;
    # 0 where L / a overflows, as the kernels')
    inverse = torch.full_like(largest, ACTIVATION_LEVELS) / torch.where(finite, largest, 1.0)
    inverse = torch.where(finite & torch.isfinite(inverse), inverse, 0.0)
    q = torch.round(groups * inverse)  # ties to even, as vcvtps2dq
    return (q * (largest / ACTIVATION_LEVELS)).view(rows, -1)[:, :k]


def enabled_for(x: torch.Tensor) -> bool:
    """Whether the fused kernels handle this activation tensor (fp32 on the CPU)."""
    return x.dtype == torch.float32 and kernels_on(x)


def kernels_on(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for tensors on x's device (the CPU, kernels built and on)."""
    return _kernels_on and x.device.type == "cpu" and load_extension() is not None


@contextmanager
def use_kernels(enabled: bool) -> Iterator[None]:
    """Turn the fused kernels off (or back on) inside a block: tests compare both paths."""
    global _kernels_on
    saved, _kernels_on = _kernels_on, enabled
    try:
        yield
    finally:
        _kernels_on = saved


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised tensor that, on a Linux CPU with the extension, is backed by
    transparent huge pages where the kernel allows (madvise, before the first touch): the KV
    pool's scattered block reads then stop missing the TLB (shuffled-pool decode attention
    measured 746 -> 464 us per layer)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.device.type == "cpu" and load_extension() is not None:
        _ext.advise_huge_pages(t)
    return t


_HUGE_PAGE = 2 << 20


def copy_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of these CPU tensors laid end to end, in order, in one buffer backed by
    transparent huge pages (2 MB-aligned, 64-byte-aligned entries). A decode step streams
    every weight once: with 4 KB pages that is a TLB miss every 4 KB, ~24 k per token for
    SmolLM2's int4 weights; measured 7.1-7.5 -> 6.4-6.5 ms per int4 decode step. Returns the
    inputs themselves where huge pages are unavailable."""
    if not tensors or load_extension() is None or any(t.device.type != "cpu" for t in tensors):
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // 64) * 64
    arena = empty_huge_pages((total + _HUGE_PAGE,), torch.uint8, "cpu")
    start = -arena.data_ptr() % _HUGE_PAGE
    copies = []
    for t, offset, size in zip(tensors, offsets, sizes):
        view = arena[start + offset:start + offset + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        copies.append(view)
    return copies


# --------------------------------------------------------------------------------------
# Each op: the kernel when enabled_for(x), else the reference (also the tests' ground truth).
# --------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """``x / rms(x) * (offset + weight)``: offset 0 is LLaMA's RMSNorm, 1 is Gemma's."""
    if enabled_for(x) and weight.dtype == torch.float32:
        return _ext.rms_norm(x, weight, eps, offset)
    return rms_norm_reference(x, weight, eps, offset)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0:
        return weight * x32.to(x.dtype)  # HF LlamaRMSNorm: the product in the input dtype
    return (x32 * (offset + weight.float())).to(x.dtype)


def rope_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
             eps: float = 0.0, norm_offset: float = 0.0) -> None:
    """In place on ``qkv [T, (H + 2 KVH) * D]``: the optional per-head RMSNorm of q and k
    (Gemma's QK-norm), then rotary embedding of q and k. ``cos, sin``: ``[T, D]``."""
    norms_fp32 = all(w is None or w.dtype == torch.float32 for w in (q_norm, k_norm))
    if enabled_for(qkv) and qkv.stride(-1) == 1 and cos.dtype == torch.float32 and norms_fp32:
        _ext.rope_qk_(qkv, cos.contiguous(), sin.contiguous(), num_heads, num_kv_heads, head_dim,
                      q_norm, k_norm, eps, norm_offset)
        return
    rope_qk_reference_(qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, norm_offset)


def rope_qk_reference_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                       num_kv_heads: int, head_dim: int, q_norm: Optional[torch.Tensor],
                       k_norm: Optional[torch.Tensor], eps: float, norm_offset: float) -> None:
    n = qkv.shape[0]
    rotated = qkv[:, :(num_heads + num_kv_heads) * head_dim]
    q = rotated[:, :num_heads * head_dim].view(n, num_heads, head_dim)
    k = rotated[:, num_heads * head_dim:].view(n, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_reference(q, q_norm, eps, norm_offset)
    if k_norm is not None:
        k = rms_norm_reference(k, k_norm, eps, norm_offset)
    rotated.copy_(torch.cat((apply_rope(q, cos, sin).reshape(n, -1), apply_rope(k, cos, sin).reshape(n, -1)), -1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` (HF ``rotate_half`` convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv_cache_kernel(k: torch.Tensor, v: torch.Tensor, kv_data: torch.Tensor,
                          kv_scales: Optional[torch.Tensor], slot_mapping: torch.Tensor) -> bool:
    """Store this step's keys/values ``[T, KVH, D]`` at their flat slots of one layer's cache
    (``kvserve.kv_cache.LayerKV``'s tensors; int8 caches quantize here); False, writing
    nothing, where the kernel does not apply (``LayerKV.write_reference`` is the torch path)."""
    if not (enabled_for(k) and v.dtype == torch.float32 and k.stride(-1) == 1 and v.stride(-1) == 1):
        return False
    _ext.write_kv_cache(k, v, kv_data, kv_scales, slot_mapping)
    return True


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``x = [gate | up]`` of shape ``[T, 2 I]``."""
    if enabled_for(x) and activation in ACTIVATION_CODES and x.dim() == 2 and x.stride(-1) == 1:
        return _ext.act_and_mul(x, ACTIVATION_CODES[activation])
    return act_and_mul_reference(x, activation)


def act_and_mul_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` of a 2-D tensor (sorted, descending); on the kernels ties go to
    the lower index, so ``top_k(x, 1)`` is ``x.argmax(-1)``. For small k (candidates for
    rescoring, logprobs) the kernel insertion-sorts what it keeps; for more (the sampler's
    top-p candidates) another selects them from a threshold (3-4x torch's topk at k = 1,024)."""
    if enabled_for(x) and x.dim() == 2 and x.stride(-1) == 1 and 0 < k <= x.shape[-1]:
        return _ext.top_k_rows(x, k) if k <= 64 else _ext.top_k_rows_select(x, k)
    values, indices = x.topk(k, dim=-1)
    return values, indices


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    """A copy of ``logits`` [S, V] with -inf at every token the grammar of a constrained row
    forbids: row ``rows[r]`` follows ``bitmask[r]`` (int32 words on the host, bit t % 32 of
    word t / 32 allowing token t; tokens past the bitmask are forbidden)."""
    if enabled_for(logits) and logits.dim() == 2 and logits.is_contiguous():
        return _ext.apply_token_bitmask(logits, torch.from_numpy(bitmask),
                                        torch.tensor(rows, dtype=torch.int64))
    return apply_token_bitmask_reference(logits, rows, bitmask)


def apply_token_bitmask_reference(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = np.zeros((len(rows), vocab), dtype=np.bool_)
    allowed[:, :bits.shape[1]] = bits
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    mask = torch.from_numpy(allowed).to(logits.device)
    masked = torch.where(mask, logits.index_select(0, index), float("-inf"))
    return logits.index_copy(0, index, masked)


def _kernel_rows(x: torch.Tensor) -> bool:
    """Whether the row kernels (argmax, sampling) take ``x``: [S, V] with contiguous rows, V > 0."""
    return enabled_for(x) and x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] > 0


def sample_rows(x: torch.Tensor, inv_temperature: torch.Tensor, log_min_p: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of logits ``x`` [S, V]: token t with probability proportional to
    ``exp((x[t] - max) * inv_temperature)`` among those whose scaled logit is at least
    ``max + log_min_p`` (min-p; -inf keeps every finite logit), drawn by inverting the
    cumulative distribution at ``uniforms`` (float64 in [0, 1), one per row). Rows with
    nothing finite take their argmax."""
    inv_temperature, log_min_p = inv_temperature.reshape(-1).float(), log_min_p.reshape(-1).float()
    if _kernel_rows(x):
        return _ext.sample_rows(x, inv_temperature.contiguous(), log_min_p.contiguous(),
                                uniforms.to(torch.float64).contiguous())
    return sample_rows_reference(x, inv_temperature, log_min_p, uniforms)


def sample_rows_reference(x: torch.Tensor, inv_temperature: torch.Tensor, log_min_p: torch.Tensor,
                          uniforms: torch.Tensor) -> torch.Tensor:
    """The kernel's sampling in plain torch (weights summed in another order)."""
    m = x.amax(dim=-1, keepdim=True)
    z = (x - m) * inv_temperature.unsqueeze(1)
    weights = torch.where(z >= log_min_p.unsqueeze(1), torch.exp(z.clamp(max=0.0)), 0.0).double()
    cumulative = weights.cumsum(dim=-1)
    target = uniforms.double().unsqueeze(1) * cumulative[:, -1:]
    token = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    # Past the end by rounding: the last weighed token; nothing weighed: the argmax.
    last = x.shape[-1] - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
    token = torch.minimum(token, last)
    return torch.where(torch.isfinite(m.squeeze(1)) & (cumulative[:, -1] > 0), token, x.argmax(dim=-1))


def top_p_floor(x: torch.Tensor, inv_temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of logits ``x`` [S, V]: the scaled logit ``(x - max) * inv_temperature`` of the
    last token the row's top-p nucleus keeps (sorted by logit, a token is kept while the mass
    before it is under ``top_p``), so that the nucleus is every token at or above it; -inf
    for rows with nothing finite. The kernel bins the mass instead of sorting the row."""
    inv_temperature, top_p = inv_temperature.reshape(-1).float(), top_p.reshape(-1).float()
    if _kernel_rows(x):
        return _ext.top_p_floor(x, inv_temperature.contiguous(), top_p.contiguous())
    return top_p_floor_reference(x, inv_temperature, top_p)


def top_p_floor_reference(x: torch.Tensor, inv_temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The kernel's floor by a full sort."""
    m = x.amax(dim=-1, keepdim=True)
    z = ((x - m) * inv_temperature.unsqueeze(1)).sort(dim=-1, descending=True).values
    weights = torch.exp(z).double()
    before = weights.cumsum(dim=-1) - weights
    kept = (before < top_p.double().unsqueeze(1) * weights.sum(dim=-1, keepdim=True)) & (weights > 0)
    last = kept.sum(dim=-1).clamp(min=1) - 1
    floor = z.gather(1, last.unsqueeze(1)).squeeze(1)
    return torch.where(torch.isfinite(m.squeeze(1)), floor, torch.full_like(floor, float("-inf")))


def row_logsumexp(x: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """``(x * inv_temperature[:, None]).logsumexp(-1)`` of a 2-D tensor, without the [S, V]
    temporaries on the kernel."""
    inv_temperature = inv_temperature.reshape(-1).float()
    if _kernel_rows(x):
        return _ext.row_logsumexp(x, inv_temperature.contiguous())
    return (x * inv_temperature.unsqueeze(1)).logsumexp(dim=-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a 2-D tensor."""
    if _kernel_rows(x):
        return _ext.top_k_rows(x, 1)[1][:, 0]
    return x.argmax(dim=-1)


def paged_attention_kernel(out: torch.Tensor, q: torch.Tensor, kv_data: torch.Tensor,
                           kv_scales: Optional[torch.Tensor], block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, seq_ids: torch.Tensor, query_starts: torch.Tensor,
                           query_lens: torch.Tensor, scale: float, window: Optional[int],
                           softcap: Optional[float]) -> None:
    """Causal attention over one layer's paged cache (``LayerKV``'s tensors, which must
    already hold the step's keys; int8 values are scaled in registers) for
    sequences ``seq_ids``: ``query_lens[i]`` query rows from ``query_starts[i]`` of
    ``q [T, H, D]``, the last one at position ``seq_lens[seq] - 1``; written to the same rows
    of ``out``. Decode sequences are the one-query case. Only with the extension loaded;
    kvserve.attention holds the torch path."""
    load_extension().paged_attention(out, q, kv_data, kv_scales, block_tables, seq_lens, seq_ids, query_starts, query_lens,
                                     scale, window or 0, softcap or 0.0)
