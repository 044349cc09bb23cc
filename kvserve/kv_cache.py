"""The KV cache as one object: layout, dtype, quantization scales, sizing and the views that
attention and the C++ kernels read. Nothing else describes the layout.

Layout, per layer: ``data [2, num_kv_heads, num_blocks, block_size, head_dim]`` (index 0 =
keys, 1 = values). Token ``i`` of a sequence lives at offset ``i % block_size`` of block
``block_table[i // block_size]``, in every head. Heads come first so that a head's blocks are
contiguous. Values are stored ``[block_size, head_dim]`` per block; keys are stored
transposed, ``[head_dim, block_size]`` per block (``key_blocks()``): the scores of a query
against a block are then a sum over ``d`` of ``q[d]`` times a contiguous row of the block's
keys, vector operations over the block's tokens with no horizontal sums, which is how the CPU
kernels compute them.

KV cache groups (issue #12; vLLM's hybrid KV cache layout): the layers are split into groups
of equal size, full attention or one sliding window (``KVCacheSpec.groups``); a request has one
block table per group, and a sliding group gives back the blocks out of its window. One pool of
block ids serves every group: the cache holds one tensor per *slot* (position within a group),
``num_blocks`` blocks each, and layer L lives in slot ``slot_of(L)`` of its group, addressed
through that group's table. A block id is thus ``slots_per_group`` layers' worth of one block,
the same bytes in every group. A model with one group has one slot per layer, one tensor per
layer, as before groups: LLaMA (one full group), Mistral (one sliding group: every layer has
the same window), any model under ``--no-sliding-window-reclaim`` (one full group).

A pipeline stage holds only its own layers (``KVCacheSpec.restrict``): the same groups, by
index and window (group g still reads the step's table g), each cut down to the stage's layers,
so a stage may hold fewer slot tensors than the whole model has slots.

INT8 (``kv_cache_dtype="int8"``): symmetric int8 with fp16 scales, for keys and values
separately, one scale per token, KV head and group of 32 dims, in ``scales [2, num_kv_heads,
num_blocks, groups, block_size]``. Before quantizing, each head vector is rotated by the
normalised Walsh-Hadamard transform H (orthonormal and its own inverse): ``q . k = Hq . Hk``
and ``sum_t p_t v_t = H sum_t p_t Hv_t``, so attention works in the rotated basis (queries
rotated on the way in, outputs rotated back) and never needs the original. The rotation
spreads a few outlier channels over all dims, which per-token scales cannot absorb: measured
top-1 agreement with a bf16 cache (teacher-forced, 312 / 2,200 tokens) went from 98.7 / 98.2 %
to 99.0 / 99.1 % on SmolLM2 and from 97.1 / 95.4 % to 100 / 98.5 % on Gemma 3 (with 64-dim
groups; one scale per 256-dim head: 98.4 % on the short text). Why 32 dims (issue 64): 64-dim
groups still missed greedy agreement with an fp32 cache on held-out code (Gemma 3: 5 of 8
continuations identical) and sat at the 99 % top-1 bar; benchmarks/int8_kv_schemes.py
compares the groupings and a KIVI-style per-channel key scale by simulation (numbers in
tests/test_precision.py's note). Why per token: a token is written once, when it is computed,
so its scales never change afterwards (a per-block or per-channel scale would have to
requantize the block as it fills, or keep a filling block in another format, and prefix-cached
blocks would depend on what was written after them). Scales factor out of the products
(``Hq . Hk_t = sum_g s_tg (Hq_g . k8_tg)``, and ``p_t v_t`` takes ``p_t s_tg``), so attention
applies them per token and group in registers and never materialises a dequantized block.
Cost: 2 bytes per 32 int8 values, so a head holds 1.88x the tokens of bf16 in the same memory
(64-dim groups: 1.94x; issue 64's floor is 1.85x).

MLA (DeepSeek's multi-head latent attention, ``KVCacheSpec.latent``): a layer keeps per token
one entry shared by every head, its compressed latent (``kv_lora_rank`` values, after
``kv_a_layernorm``) followed by its rope key (``qk_rope_head_dim``), in ``data [num_blocks,
block_size, kv_lora_rank + qk_rope_head_dim]`` (``LatentLayerKV``): no per-head keys or values
(attention expands or absorbs them from the latent, kvserve/latent_attention.py). It is paged,
grouped and prefix-cached as any layer (one full group: DeepSeek has no sliding layers). INT8
quantizes the latent and the rope key as two vectors, each rotated by its own Hadamard
transform with scales per 32 dims (``[num_blocks, block_size, groups]``): the two parts are
powers of two in every DeepSeek shape (512 + 64) where their concatenation is not; attention
dequantizes what it gathers.

Within a block the int8 elements are paired for the CPU's int16 dot-product instruction (two
products summed per 32-bit lane): keys ``[head_dim / 2, block_size, 2]`` (dims 2i and 2i+1 of
a token side by side), values ``[block_size / 2, head_dim, 2]`` (tokens 2j and 2j+1 of a dim
side by side); ``block_keys``/``block_values`` read either back as ``[.., block_size, head_dim]``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from kvserve import ops
from kvserve.config import ConfigError, ModelConfig

# Storage dtype of each kv_cache_dtype name (config.KV_CACHE_DTYPES lists the choices).
_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SCALE_DTYPE = torch.float16
INT8_MAX = 127
INT8_GROUP = 32  # dims per scale (fewer when the head is smaller; why 32: the module note)


def int8_group_size(head_dim: int) -> int:
    return min(INT8_GROUP, head_dim)


def kv_dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """The canonical name (``float32``, ``bfloat16``, ``float16``, ``int8``) of a KV dtype."""
    if isinstance(dtype, torch.dtype):
        for name, storage in _STORAGE.items():
            if storage == dtype:
                return name
        raise ConfigError(f"unsupported KV cache dtype {dtype}")
    name = _ALIASES.get(dtype, dtype)
    if name not in _STORAGE:
        raise ConfigError(f"unknown kv_cache_dtype {dtype!r}; use one of {', '.join(_STORAGE)}")
    return name


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose KV shares one block table per request: full attention (``window`` None)
    or one sliding window of ``window`` tokens, whose blocks a request gives back once no
    future query can see them."""

    layers: tuple[int, ...]
    window: Optional[int] = None

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class LatentKV:
    """MLA's entry per token and layer: the compressed latent, then the rope key."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def parts(self) -> tuple[int, int]:
        """The widths quantized apart (each rotated on its own, see the module's note)."""
        return self.kv_lora_rank, self.qk_rope_head_dim

    def describe(self) -> str:
        return f"({self.kv_lora_rank} latent + {self.qk_rope_head_dim} rope key)"


def model_latent_kv(config: ModelConfig) -> Optional[LatentKV]:
    """The model's MLA cache entry; None for per-head K/V."""
    return LatentKV(config.kv_lora_rank, config.qk_rope_head_dim) if config.uses_mla else None


def _is_int8_rotatable(dim: int) -> bool:
    return dim >= 16 and not dim & (dim - 1)


def kv_cache_groups(config: ModelConfig, reclaim_sliding_window: bool = True) -> tuple[KVCacheGroup, ...]:
    """Split the layers into groups of equal size, so that a block (one block id of the shared
    pool) holds the same bytes in every group; full groups first.

    The group size is the gcd of the layer counts per attention kind (Gemma 3: 3 full and 15
    sliding layers -> six groups of 3; tiny-gemma3: 1 and 3 -> four groups of 1): equal groups
    with no padding, at the price of more block tables per request when the gcd is small. A
    model whose every layer slides in one window (Mistral) is one sliding group of every layer:
    one table per request, which gives back what the window has passed (its prefix-cache hits
    are verified without a full group, kvserve/prefix_index.py). A model with full attention
    only (LLaMA), or reclaim turned off, is one full group of every layer, as before.
    """
    n = config.num_hidden_layers
    kinds: dict[Optional[int], list[int]] = {}
    for layer in range(n):
        window = config.sliding_window if config.is_sliding(layer) and config.sliding_window else None
        kinds.setdefault(window, []).append(layer)
    if not reclaim_sliding_window or list(kinds) == [None]:
        return (KVCacheGroup(tuple(range(n))),)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    groups = []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[window]
        groups.extend(KVCacheGroup(tuple(layers[i:i + size]), window) for i in range(0, len(layers), size))
    return tuple(groups)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token costs and how the tensors are shaped; torch dtypes derived from ``dtype``.

    ``groups`` (default: one full group of every layer) say which layers share a block table.
    A whole model's groups all have ``slots_per_group`` layers; the cache holds one tensor per
    slot, of ``num_blocks`` blocks, and layer L reads and writes slot ``slot_of(L)`` through its
    group's block table, so one block id is one block in every slot.

    ``first_layer``: the spec covers layers ``[first_layer, first_layer + num_layers)`` of the
    model, by their global indices (a pipeline stage's, see ``restrict``); there its groups may
    be of unequal size or empty, and ``slots_per_group`` is the largest.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a kv_dtype_name (a torch dtype or an alias is normalised to one)
    groups: tuple[KVCacheGroup, ...] = ()
    first_layer: int = 0
    # MLA: one latent entry per token (num_kv_heads 1, head_dim its width), no values.
    latent: Optional[LatentKV] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", kv_dtype_name(self.dtype))
        if self.latent is not None:
            if self.num_kv_heads != 1 or self.head_dim != self.latent.width:
                raise ConfigError(f"an MLA cache holds one entry of {self.latent.width} per token, "
                                  f"not {self.num_kv_heads} heads of {self.head_dim}")
            if self.is_quantized and not all(_is_int8_rotatable(d) for d in self.latent.parts):
                raise ConfigError(f"an int8 MLA cache rotates the latent and the rope key apart: both must be "
                                  f"powers of two >= 16 (got {self.latent.kv_lora_rank} and "
                                  f"{self.latent.qk_rope_head_dim})")
        elif self.is_quantized and (self.block_size % 2 or not _is_int8_rotatable(self.head_dim)):
            raise ConfigError(f"an int8 KV cache pairs tokens and rotates heads: it needs an even block size "
                              f"(got {self.block_size}) and a power-of-two head dim >= 16 (got {self.head_dim})")
        if not self.groups:
            object.__setattr__(self, "groups", (KVCacheGroup(tuple(self.layer_ids)),))
        # Groups of unequal size would still be addressed correctly (slots_per_group is the
        # largest; a smaller group's blocks leave the other slots unused): kv_cache_groups makes
        # a whole model's equal, and a pipeline stage's cut of them (restrict) may not be.
        layers = sorted(layer for group in self.groups for layer in group.layers)
        if layers != list(self.layer_ids):
            raise ConfigError(f"KV cache groups must cover each of the layers {self.first_layer}.."
                              f"{self.first_layer + self.num_layers - 1} once: {self.groups}")

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: Union[str, torch.dtype],
                  reclaim_sliding_window: bool = True, groups: Optional[tuple[KVCacheGroup, ...]] = None,
                  num_kv_heads: Optional[int] = None) -> "KVCacheSpec":
        """The whole model's cache: its groups (``kv_cache_groups`` unless given) and KV heads
        (``num_kv_heads``: a tensor-parallel rank's share). An MLA model's latent entry is
        every head's, so a rank holds all of it whatever its heads."""
        groups = groups if groups is not None else kv_cache_groups(config, reclaim_sliding_window)
        latent = model_latent_kv(config)
        if latent is not None:
            return cls(config.num_hidden_layers, 1, latent.width, block_size, dtype, groups, latent=latent)
        return cls(config.num_hidden_layers, num_kv_heads or config.num_key_value_heads, config.head_dim,
                   block_size, dtype, groups)

    def restrict(self, start: int, end: int) -> "KVCacheSpec":
        """The part of this whole-model spec that holds layers ``[start, end)`` (a pipeline
        stage's). Every group stays, with its index and window, so that the step's table g is
        still group g's; each keeps only its layers in the range, in order, so a layer's slot
        becomes its position among its group's layers on the stage: the stage allocates as
        many slot tensors as its fullest group needs, not the model's ``slots_per_group``."""
        if self.first_layer != 0 or not 0 <= start < end <= self.num_layers:
            raise ValueError(f"cannot restrict layers {self.first_layer}..{self.first_layer + self.num_layers - 1} "
                             f"to [{start}, {end})")
        groups = tuple(KVCacheGroup(tuple(layer for layer in g.layers if start <= layer < end), g.window)
                       for g in self.groups)
        return dataclasses.replace(self, num_layers=end - start, groups=groups, first_layer=start)

    @property
    def layer_ids(self) -> range:
        """The (global) indices of the layers this spec holds, in the model's order."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE[self.dtype]

    @property
    def is_quantized(self) -> bool:
        return self.dtype == "int8"

    @property
    def element_bytes(self) -> int:
        return self.storage_dtype.itemsize

    @property
    def scale_groups(self) -> int:
        """Scales per token, KV head and K-or-V (MLA: per latent entry): 0 for float caches."""
        if not self.is_quantized:
            return 0
        parts = self.latent.parts if self.latent is not None else (self.head_dim,)
        return sum(d // int8_group_size(d) for d in parts)

    @property
    def tensors_per_head(self) -> int:
        """2 (keys and values), or 1 for MLA's latent entry (keys and values both read it)."""
        return 1 if self.latent is not None else 2

    @property
    def scale_bytes_per_head(self) -> int:
        return self.scale_groups * SCALE_DTYPE.itemsize

    # ---- groups --------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def slots_per_group(self) -> int:
        """Slot tensors per block id: the layers of the largest group (all groups of a whole
        model are equal; a pipeline stage's cut of them need not be)."""
        return max(len(g.layers) for g in self.groups)

    @property
    def group_windows(self) -> list[Optional[int]]:
        """Each group's sliding window (None: full attention), what the KV manager takes."""
        return [g.window for g in self.groups]

    @property
    def has_sliding_groups(self) -> bool:
        return any(g.is_sliding for g in self.groups)

    def group_of(self, layer: int) -> int:
        return self._layer_map[layer][0]

    def slot_of(self, layer: int) -> int:
        return self._layer_map[layer][1]

    @functools.cached_property
    def _layer_map(self) -> dict[int, tuple[int, int]]:
        return {layer: (g, s) for g, group in enumerate(self.groups) for s, layer in enumerate(group.layers)}

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def bytes_per_layer_token(self) -> int:
        """One token of one layer: 2 (K and V) x kv heads x (head dim x element bytes + scales);
        MLA: one entry of (latent + rope key) x element bytes (+ scales)."""
        return self.tensors_per_head * self.num_kv_heads * (self.head_dim * self.element_bytes
                                                            + self.scale_bytes_per_head)

    @property
    def bytes_per_token(self) -> int:
        """A token held in every layer (what a cache without groups pays per token)."""
        return self.num_layers * self.bytes_per_layer_token

    @property
    def bytes_per_group_token(self) -> int:
        """A token held in one group: its ``slots_per_group`` layers."""
        return self.slots_per_group * self.bytes_per_layer_token

    @property
    def bytes_per_block(self) -> int:
        """One block id of the pool: a block of every slot."""
        return self.bytes_per_group_token * self.block_size

    def describe_token(self) -> str:
        """The bytes-per-token formula with this cache's numbers, for the start-up line."""
        if self.latent is not None:
            entry = f"{self.latent.describe()} x {self.element_bytes} bytes"
            if self.is_quantized:
                entry = f"({entry} + {self.scale_bytes_per_head} bytes of scale)"
            return (f"MLA latent: {self.num_layers} layers x {entry} = {self.bytes_per_token} bytes per token, "
                    f"{self.dtype}")
        per_head = f"{self.head_dim} head dim x {self.element_bytes} bytes"
        if self.is_quantized:
            per_head = f"({per_head} + {self.scale_bytes_per_head} bytes of scale)"
        return (f"2 x {self.num_layers} layers x {self.num_kv_heads} kv heads x {per_head} "
                f"= {self.bytes_per_token} bytes per token, {self.dtype}")


@dataclass
class LayerKV:
    """One layer's cache: ``data`` in the layout above and, for int8, its ``scales``; ``group``
    picks the block table (``AttentionMetadata.for_group``) its block ids come from. Layers of
    different groups in the same slot share the tensors."""

    data: torch.Tensor  # [2, KVH, NB, BS, D]
    scales: Optional[torch.Tensor] = None  # [2, KVH, NB, groups, BS] fp16, int8 caches only
    group: int = 0

    @property
    def block_size(self) -> int:
        return self.data.shape[3]

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[1]

    @property
    def head_dim(self) -> int:
        return self.data.shape[4]

    @property
    def is_quantized(self) -> bool:
        return self.scales is not None

    def compute_dtype(self, activation_dtype: torch.dtype) -> torch.dtype:
        """The dtype the torch path attends in: the cache's for float caches (a bf16 cache
        rounded its keys on the way in anyway, and SDPA runs twice as fast in bf16), the
        activations' for int8."""
        return activation_dtype if self.is_quantized else self.data.dtype

    def key_blocks(self) -> torch.Tensor:
        """The keys as stored: ``[KVH, NB, head_dim, block_size]`` for float caches, ``[KVH,
        NB, head_dim / 2, block_size, 2]`` for int8."""
        _, kvh, nb, bs, d = self.data.shape
        if self.is_quantized:
            return self.data[0].view(kvh, nb, d // 2, bs, 2)
        return self.data[0].view(kvh, nb, d, bs)

    def value_blocks(self) -> torch.Tensor:
        """The values as stored: ``[KVH, NB, block_size, head_dim]`` for float caches, ``[KVH,
        NB, block_size / 2, head_dim, 2]`` for int8."""
        _, kvh, nb, bs, d = self.data.shape
        if self.is_quantized:
            return self.data[1].view(kvh, nb, bs // 2, d, 2)
        return self.data[1]

    def block_keys(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The stored keys of these blocks as ``[KVH, n, block_size, head_dim]`` (a copy)."""
        keys = self.key_blocks().index_select(1, block_ids)
        if self.is_quantized:  # [KVH, n, D/2, BS, 2] -> [KVH, n, BS, D/2, 2]
            return keys.permute(0, 1, 3, 2, 4).reshape(*keys.shape[:2], self.block_size, self.head_dim)
        return keys.transpose(2, 3)

    def block_values(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The stored values of these blocks as ``[KVH, n, block_size, head_dim]``."""
        values = self.value_blocks().index_select(1, block_ids)
        if self.is_quantized:  # [KVH, n, BS/2, D, 2] -> [KVH, n, BS/2, 2, D]
            return values.transpose(3, 4).reshape(*values.shape[:2], self.block_size, self.head_dim)
        return values

    def gather_keys(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys of the given blocks, in order, as ``[num_kv_heads, len(block_ids) * block_size,
        head_dim]`` in ``dtype`` (dequantized for int8: the torch reference path's copy)."""
        return self._dequantize(self.block_keys(block_ids).flatten(1, 2), 0, block_ids, dtype)

    def gather_values(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values of the given blocks, like ``gather_keys``."""
        return self._dequantize(self.block_values(block_ids).flatten(1, 2), 1, block_ids, dtype)

    def _dequantize(self, x: torch.Tensor, kv: int, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.scales is None:
            return x.to(dtype)
        scales = self.scales[kv].index_select(1, block_ids).transpose(2, 3).flatten(1, 2)  # [KVH, n * BS, groups]
        return dequantize_int8(x, scales).to(dtype)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's keys/values ``[T, KVH, D]`` at their flat slots (the fused write
        kernel where it applies, else plain torch; the two agree bit for bit)."""
        if ops.write_kv_cache_kernel(k, v, self.data, self.scales, slot_mapping):
            return
        self.write_reference(k, v, slot_mapping)

    def write_reference(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        block_size = self.block_size
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        if self.scales is not None:
            k, k_scales = quantize_int8(k)
            v, v_scales = quantize_int8(v)
            self.scales[0, :, blocks, :, offsets] = k_scales  # [T, KVH, groups]
            self.scales[1, :, blocks, :, offsets] = v_scales
            # Advanced indices apart from each other go first: [T, KVH, D/2, 2] and [T, KVH, D].
            self.key_blocks()[:, blocks, :, offsets] = k.unflatten(-1, (-1, 2))
            self.value_blocks()[:, blocks, offsets // 2, :, offsets % 2] = v
            return
        self.key_blocks()[:, blocks, :, offsets] = k.to(self.data.dtype)  # [T, KVH, D]
        values = self.data[1].flatten(1, 2)  # [KVH, num_blocks * block_size, D]
        values.index_copy_(1, slot_mapping, v.transpose(0, 1).to(self.data.dtype))


@dataclass
class LatentLayerKV:
    """One MLA layer's cache: ``data [NB, BS, kv_lora_rank + qk_rope_head_dim]`` and, for int8,
    ``scales [NB, BS, groups]`` (the latent's groups, then the rope key's)."""

    data: torch.Tensor
    latent: LatentKV
    scales: Optional[torch.Tensor] = None
    group: int = 0

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def is_quantized(self) -> bool:
        return self.scales is not None

    def write(self, latent: torch.Tensor, rope_key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's ``latent [T, kv_lora_rank]`` and ``rope_key [T, qk_rope_head_dim]``
        (already rotated) at their flat slots."""
        slots = self.data.view(-1, self.latent.width)
        if self.scales is None:
            slots.index_copy_(0, slot_mapping, torch.cat((latent, rope_key), dim=-1).to(self.data.dtype))
            return
        (latent_q, latent_s), (rope_q, rope_s) = quantize_int8(latent), quantize_int8(rope_key)
        slots.index_copy_(0, slot_mapping, torch.cat((latent_q, rope_q), dim=-1))
        self.scales.view(-1, self.scales.shape[-1]).index_copy_(0, slot_mapping, torch.cat((latent_s, rope_s), dim=-1))

    def gather(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The entries of these blocks, in order, as ``[len(block_ids) * block_size, width]`` in
        ``dtype`` (dequantized for int8)."""
        entries = self.data.index_select(0, block_ids).flatten(0, 1)
        if self.scales is None:
            return entries.to(dtype)
        scales = self.scales.index_select(0, block_ids).flatten(0, 1)
        rank = self.latent.kv_lora_rank
        latent_groups = rank // int8_group_size(rank)
        latent = dequantize_int8(entries[:, :rank], scales[:, :latent_groups])
        rope_key = dequantize_int8(entries[:, rank:], scales[:, latent_groups:])
        return torch.cat((latent, rope_key), dim=-1).to(dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``H x`` over the last dim (a power of two), H the normalised Walsh-Hadamard matrix, in the
    butterfly order of the write kernel's (so the two agree bit for bit)."""
    d = x.shape[-1]
    x = x.float()
    h = 1
    while h < d:
        pairs = x.unflatten(-1, (d // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return x * float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (int8 values of ``H x``, fp16 scales ``[..., groups]``), symmetric per
    group of ``int8_group_size(D)`` dims; the write kernel computes exactly this (the same fp32
    operations, round half to even)."""
    x = hadamard_transform(x)
    grouped = x.unflatten(-1, (-1, int8_group_size(x.shape[-1])))
    scales = (grouped.abs().amax(dim=-1) / INT8_MAX).to(SCALE_DTYPE)
    s = scales.float()[..., None]
    q = torch.where(s > 0, torch.round(grouped / s), torch.zeros_like(grouped)).clamp_(-INT8_MAX, INT8_MAX)
    return q.flatten(-2).to(torch.int8), scales


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 head vectors ``[..., D]`` that ``quantize_int8`` stored as (values, scales)."""
    x = values.float().unflatten(-1, (scales.shape[-1], -1)) * scales.float()[..., None]
    return hadamard_transform(x.flatten(-2))


class KVCache:
    """Every layer's ``LayerKV``, allocated once for the pool's ``num_blocks`` blocks: one
    tensor (and scales) per group slot, shared by the layers in that slot of every group.
    ``layers[i]`` is layer ``spec.first_layer + i`` (a pipeline stage indexes its own layers
    from 0, as its model does)."""

    def __init__(self, spec: KVCacheSpec, layers: list[Union[LayerKV, LatentLayerKV]]) -> None:
        self.spec = spec
        self.layers = layers

    @classmethod
    def allocate(cls, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> "KVCache":
        """Zero-filled, not ``empty``: padded block-table entries and masked keys are still
        read, and uninitialised memory could hold NaNs, which survive a zero attention weight.
        (The same holds for the null block that stands for a sliding group's released blocks.)"""
        if spec.latent is not None:
            return cls(spec, cls._allocate_latent(spec, num_blocks, device))
        shape = (2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
        slots = []
        for _ in range(spec.slots_per_group):
            data = ops.empty_huge_pages(shape, spec.storage_dtype, device).zero_()
            scales = None
            if spec.is_quantized:
                scales = torch.zeros((*shape[:3], spec.scale_groups, spec.block_size), dtype=SCALE_DTYPE,
                                     device=device)
            slots.append((data, scales))
        layers = [LayerKV(*slots[spec.slot_of(layer)], group=spec.group_of(layer)) for layer in spec.layer_ids]
        return cls(spec, layers)

    @staticmethod
    def _allocate_latent(spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> list[LatentLayerKV]:
        """MLA layers' caches, one tensor per slot as for per-head caches."""
        shape = (num_blocks, spec.block_size, spec.head_dim)
        slots = []
        for _ in range(spec.slots_per_group):
            data = ops.empty_huge_pages(shape, spec.storage_dtype, device).zero_()
            scales = (torch.zeros((*shape[:2], spec.scale_groups), dtype=SCALE_DTYPE, device=device)
                      if spec.is_quantized else None)
            slots.append((data, scales))
        return [LatentLayerKV(slots[spec.slot_of(layer)][0], spec.latent, slots[spec.slot_of(layer)][1],
                              group=spec.group_of(layer)) for layer in spec.layer_ids]

    @property
    def num_blocks(self) -> int:
        if not self.layers:
            return 0
        return self.layers[0].data.shape[0 if self.spec.latent is not None else 2]

    @property
    def num_bytes(self) -> int:
        tensors = {id(t): t for layer in self.layers for t in (layer.data, layer.scales) if t is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def __getitem__(self, layer: int) -> Union[LayerKV, LatentLayerKV]:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Union[LayerKV, LatentLayerKV]]:
        return iter(self.layers)

    @functools.cached_property
    def native_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """(data tensors, scale tensors — empty for float caches, block-table group), one entry
        per layer, as decoder.cpp takes them (a slot's tensor appears once per group). Built
        once: the layers' tensors are allocated once, and every step asks."""
        return ([layer.data for layer in self.layers],
                [layer.scales for layer in self.layers if layer.scales is not None],
                [layer.group for layer in self.layers])

    @functools.cached_property
    def is_contiguous(self) -> bool:
        """Whether every layer's tensor is contiguous (the fused decoder's condition)."""
        return all(layer.data.is_contiguous() for layer in self.layers)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: Union[str, torch.dtype],
                      device: torch.device | str, reclaim_sliding_window: bool = False) -> KVCache:
    """A cache for ``config``'s layers (tests and tools; the runner allocates from its spec):
    one group of every layer, read through one block table, unless ``reclaim_sliding_window``
    (the engine's layout: then the attention metadata needs a table per group)."""
    spec = KVCacheSpec.for_model(config, block_size, dtype, reclaim_sliding_window)
    return KVCache.allocate(spec, num_blocks, device)
