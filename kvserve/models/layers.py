"""Building blocks shared by the model files: norms, rotary embeddings, linear helpers.

Numerics follow HF transformers (the parity reference): norms compute in float32, rope
tables are built in float32 from the same ``inv_freq`` formula and cast to the activations'
dtype. The arithmetic itself is in ``kvserve.ops`` (fused CPU kernels, or plain torch).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.config import ConfigError
from kvserve.token_roles import roles_of_rows


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An embedding table left uninitialised: every weight is assigned after construction, and
    nn.Embedding's own normal_ init on the meta device (where the loader builds) imports
    torch._dynamo, ~1 s of every process's first engine start."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


class RMSNorm(nn.Module):
    """LLaMA RMSNorm: ``w * normalize(x)``, the product taken in the input dtype."""

    offset = 0.0  # ops.rms_norm's: the weight as stored

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, offset=self.offset)


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: ``normalize(x) * (1 + w)`` in float32, then cast (zero-initialised w)."""

    offset = 1.0  # ops.rms_norm's: 1 + the weight

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, offset=self.offset)


def rope_inv_freq(head_dim: int, base: float, scaling: Optional[dict], device: torch.device) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with optional rope scaling:
    ``linear`` (positions / factor), ``llama3`` (HF's frequency-band rescale) or
    ``freq_factors`` (llama.cpp's per-frequency divisors, from a GGUF ``rope_freqs`` tensor)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32, device=device)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "longrope":  # the short factors: positions within the original context
        return longrope_inv_freq(head_dim, base, scaling["short_factor"], device)
    if kind == "yarn":
        return yarn_inv_freq(head_dim, base, scaling, device)
    raise ConfigError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, longrope, yarn)")


def yarn_inv_freq(head_dim: int, base: float, scaling: dict, device: torch.device | str) -> torch.Tensor:
    """YaRN (HF's ``_compute_yarn_parameters``, its order of operations): frequencies whose
    wavelength fits the original context many times are kept (extrapolated), those that fit
    it less than once are slowed by ``factor`` (interpolated), with a linear ramp between the
    dims that make ``beta_fast`` and ``beta_slow`` rotations over the original context."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (HF's guard against a zero-width ramp)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device=device).to(torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for no stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's cos/sin multiplier (HF's): the configured ``attention_factor``, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` where the config gives both
    (DeepSeek: the two cancel), else ``mscale(factor)``."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def longrope_inv_freq(head_dim: int, base: float, factors: list[float], device: torch.device | str) -> torch.Tensor:
    """``1 / (factors * base ** (2i / head_dim))``, in HF's order of operations."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * base ** exponents)


def longrope_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin multiplier (HF's ``_compute_longrope_parameters``): the configured
    ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original context))`` for a context
    stretched by ``factor`` (the ratio of the two context lengths when not configured)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RopeFrequencies:
    """``rope_inv_freq`` of one rope configuration, computed once per device (it is the same
    at every step; recomputing it cost a dozen small ops per step), and the fp32 cos/sin
    tables of positions [0, n) built from it, grown by doubling as longer sequences come (a
    step then reads its positions' rows: one op per table where the tables took five)."""

    # Positions in the first tables: a short request never grows them.
    MIN_TABLE_POSITIONS = 1024

    def __init__(self, head_dim: int, base: float, scaling: Optional[dict],
                 max_position_embeddings: Optional[int] = None) -> None:
        self.head_dim, self.base, self.scaling = head_dim, base, scaling
        # LongRoPE: its attention factor (the tables' multiplier); None for every other rope.
        self.longrope: Optional[float] = None
        if (scaling or {}).get("rope_type") == "longrope":
            self.longrope = longrope_attention_factor(scaling, max_position_embeddings or 0)
        # YaRN: its cos/sin multiplier, one for every position (1.0: none).
        self.yarn_factor = yarn_attention_factor(scaling) if (scaling or {}).get("rope_type") == "yarn" else 1.0
        self._by_device: dict[torch.device, torch.Tensor] = {}
        self._tables_by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        rope_inv_freq(head_dim, base, scaling, "cpu")  # rejects a bad scaling at load time

    def __call__(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = rope_inv_freq(self.head_dim, self.base, self.scaling, device)
        return self._by_device[device]

    def tables(self, num_positions: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin ``[n, head_dim]`` for positions 0 .. n - 1, n >= ``num_positions``:
        row p is ``rope_cos_sin(p)``'s, the same products and the same cos/sin kernels."""
        device = torch.device(device)
        tables = self._tables_by_device.get(device)
        if tables is None or tables[0].shape[0] < num_positions:
            n = max(self.MIN_TABLE_POSITIONS, 1 << max(0, num_positions - 1).bit_length())
            if tables is not None:
                n = max(n, 2 * tables[0].shape[0])
            inv_freq = self(device)
            positions = torch.arange(n, device=device)
            tables = _cos_sin(positions, torch.cat((inv_freq, inv_freq)), torch.float32)
            if self.longrope is not None:
                tables = self._longrope_tables(positions, tables)
            if self.yarn_factor != 1.0:
                tables = tuple(t * self.yarn_factor for t in tables)
            self._tables_by_device[device] = tables
        return tables

    def _longrope_tables(self, positions: torch.Tensor,
                         short: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """LongRoPE (Phi-3 128k): positions before the original context rotate by the short
        factors, later ones by the long factors, all scaled by the attention factor. HF
        switches the whole forward call once its last position passes the original context,
        which for incremental decoding is this per-position rule; a prompt longer than the
        original context differs (HF rotates its early positions by the long factors too),
        but here a token's key depends on its position alone, as the paged and prefix-cached
        KV needs."""
        scaling, factor = self.scaling, self.longrope
        long_inv = longrope_inv_freq(self.head_dim, self.base, scaling["long_factor"], positions.device)
        long = _cos_sin(positions, torch.cat((long_inv, long_inv)), torch.float32)
        is_long = (positions >= scaling["original_max_position_embeddings"]).unsqueeze(1)
        return tuple(torch.where(is_long, lt, st) * factor for st, lt in zip(short, long))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                num_positions: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_cos_sin(positions, self(device), dtype)``, read from the tables.
        ``num_positions``: a bound on ``positions`` (all below it) where the caller knows one,
        such as the step's ``AttentionMetadata.max_seq_len``; else read from the tensor."""
        if num_positions is None:
            num_positions = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = (t.index_select(0, positions) for t in self.tables(num_positions, positions.device))
        return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, head_dim]`` for the given positions (only the step's tokens)."""
    return _cos_sin(positions, torch.cat((inv_freq, inv_freq)), dtype)


def _cos_sin(positions: torch.Tensor, doubled_inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    emb = positions.float().unsqueeze(1) * doubled_inv_freq  # [T, head_dim]: each half p * inv_freq
    cos, sin = emb.cos(), emb.sin()
    return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))


def output_projection(o_proj: nn.Module, attention: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``o_proj`` of the attention output's ``rows`` (sorted, distinct; None: every row), each
    row in its own token role (models/base.py's ``last_layer_rows``)."""
    if rows is None:
        return o_proj(attention)
    with roles_of_rows(rows):
        return o_proj(attention.index_select(0, rows))
