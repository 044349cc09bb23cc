"""Paged attention: per-step metadata and the backends that read/write the paged KV cache.

The cache's layout, dtypes and views belong to ``kvserve.kv_cache.LayerKV``; attention takes
one layer's ``LayerKV`` and reads it through those views (the torch path) or hands its tensors
to the fused kernel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from kvserve import ops
from kvserve.kv_cache import LayerKV
from kvserve.tracing import label


@dataclass
class AttentionMetadata:
    """Built by the runner once per step and passed down to every attention layer.

    Sequences are flattened: query tokens of sequence ``s`` are rows
    ``query_start_loc[s]:query_start_loc[s+1]`` of the step's ``[T, ...]`` tensors.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_start_loc: list[int]  # [S+1] python ints
    context_lens: list[int]  # [S] tokens already in the cache before this step
    seq_lens: list[int]  # [S] context_lens + query lens: tokens attended after this step
    block_size: int
    # Device copies, for vectorised backends.
    seq_lens_tensor: Optional[torch.Tensor] = None  # [S] int32
    query_start_loc_tensor: Optional[torch.Tensor] = None  # [S+1] int32
    # KV cache groups (kvserve.kv_cache.KVCacheGroup): slot_mapping and block_tables above are
    # group 0's; group g >= 1 has its own at index g - 1 here (a sliding-window group's tables
    # point at the null block, zeros, where its keys are out of every query's sight).
    group_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    group_block_tables: list[torch.Tensor] = field(default_factory=list)
    # Tensors a backend derives from the above (gather indices, masks): built by the first
    # layer that needs them and reused by the others. Lives and dies with this step.
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        return 1 + len(self.group_block_tables)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata a layer of KV cache group ``group`` reads: that group's slot mapping
        and block tables (with their own derived tensors), the rest shared."""
        if group == 0:
            return self
        key = ("group", group)
        if key not in self.derived:
            self.derived[key] = dataclasses.replace(
                self, slot_mapping=self.group_slot_mappings[group - 1],
                block_tables=self.group_block_tables[group - 1], group_slot_mappings=[], group_block_tables=[],
                derived={})
        return self.derived[key]

    def all_slot_mappings(self) -> list[torch.Tensor]:
        return [self.slot_mapping, *self.group_slot_mappings]

    def all_block_tables(self) -> list[torch.Tensor]:
        return [self.block_tables, *self.group_block_tables]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_all_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence after this step (0 without any): every position of the step
        is below it, so rope tables of this many positions cover the step."""
        return max(self.seq_lens, default=0)

    @property
    def query_lens(self) -> list[int]:
        qsl = self.query_start_loc
        return [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
    group_block_tables: Sequence[Sequence[Sequence[int]]] = (),
) -> AttentionMetadata:
    """Metadata for sequences given their block tables, cached lengths and new-token counts
    (a convenience for tests and tools; the runner builds its own from a SchedulerOutput).
    ``group_block_tables``: per KV cache group after group 0, every sequence's table."""
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]

    def tensors(tables_of_group: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(1, max((len(t) for t in tables_of_group), default=1))
        tables = torch.zeros(len(tables_of_group), width, dtype=torch.int32)
        slots = []
        for s, table in enumerate(tables_of_group):
            table_t = torch.as_tensor(list(table), dtype=torch.int64)
            tables[s, : len(table)] = table_t.to(torch.int32)
            pos = torch.arange(context_lens[s], seq_lens[s])
            slots.append(table_t[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        return slot_mapping.to(device), tables.to(device)

    slot_mapping, tables = tensors(block_tables)
    groups = [tensors(g) for g in group_block_tables]
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=tables,
        query_start_loc=qsl,
        context_lens=list(context_lens),
        seq_lens=seq_lens,
        block_size=block_size,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc_tensor=torch.tensor(qsl, dtype=torch.int32, device=device),
        group_slot_mappings=[g[0] for g in groups],
        group_block_tables=[g[1] for g in groups],
    )


# --------------------------------------------------------------------------------------
# Torch reference backend
# --------------------------------------------------------------------------------------


@dataclass
class DecodePlan:
    """How the single-token (decode) sequences of a step read the cache, for one window size.

    Each sequence gathers only the blocks that hold keys it can see (for a sliding layer, the
    last ``window`` keys), padded to the longest; ``key_mask`` hides the padding.
    """

    rows: Optional[torch.Tensor]  # [Sd] their rows of T; None when every row is one, in order
    block_ids: torch.Tensor  # [Sd * nb] int64, flattened
    num_blocks: int  # nb, blocks gathered per sequence
    key_mask: torch.Tensor  # [Sd, 1, 1, nb * block_size] bool: key visible
    key_bias: torch.Tensor  # the same as an additive float32 mask: 0 visible, -inf hidden


# Decode sequences are padded to the longest of their group; a sequence joins a new group
# when padding it to the group's length would waste more than this share of the gather.
_MAX_PADDING_WASTE = 0.4


def kernel_rows(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence indices, first query rows, query counts) of every sequence of the step, as the
    fused kernel takes them; built once per step and shared by the layers."""
    key = "kernel_rows"
    if key not in md.derived:
        device = md.block_tables.device
        md.derived[key] = tuple(torch.tensor(column, dtype=torch.int64, device=device) for column in (
            list(range(md.num_seqs)), md.query_start_loc[:-1], md.query_lens))
    return md.derived[key]


def decode_plans(md: AttentionMetadata, window: Optional[int]) -> list[DecodePlan]:
    key = ("torch.decode", window)
    if key not in md.derived:
        md.derived[key] = _build_decode_plans(md, window)
    return md.derived[key]


def _visible_blocks(md: AttentionMetadata, seq: int, window: Optional[int]) -> tuple[int, int]:
    """(first key a decode query of ``seq`` sees, number of blocks holding its visible keys)."""
    n = md.seq_lens[seq]
    # The query sits at position n - 1; a window of W shows it keys n - W .. n - 1.
    first_key = max(0, n - window) if window else 0
    return first_key, -(-n // md.block_size) - first_key // md.block_size


def _build_decode_plans(md: AttentionMetadata, window: Optional[int]) -> list[DecodePlan]:
    """Group the decode sequences by how many blocks they read, longest first, so that a few
    long contexts don't make every short one gather (and attend over) padding."""
    seqs = [s for s, n in enumerate(md.query_lens) if n == 1]
    if not seqs:
        return []
    nblocks = {s: _visible_blocks(md, s, window)[1] for s in seqs}
    groups: list[list[int]] = []
    for s in sorted(seqs, key=lambda s: -nblocks[s]):
        if not groups or nblocks[s] < (1 - _MAX_PADDING_WASTE) * nblocks[groups[-1][0]]:
            groups.append([])
        groups[-1].append(s)
    if len(groups) == 1:
        groups = [seqs]  # keep step order: with no prefill rows, no scatter is needed
    return [_build_decode_plan(md, window, g) for g in groups]


def _build_decode_plan(md: AttentionMetadata, window: Optional[int], seqs: list[int]) -> DecodePlan:
    bs = md.block_size
    device = md.block_tables.device
    seq_lens = [md.seq_lens[s] for s in seqs]
    first_keys = [_visible_blocks(md, s, window)[0] for s in seqs]
    first_blocks = [f // bs for f in first_keys]
    nb = max(_visible_blocks(md, s, window)[1] for s in seqs)

    first_block_t = torch.tensor(first_blocks, dtype=torch.int64, device=device)
    # Padding columns repeat the sequence's own last block rather than the table's padding:
    # a sequence never touches blocks it does not own (masked or not; NaN * 0 is NaN).
    last_block_t = torch.tensor([-(-n // bs) - 1 for n in seq_lens], dtype=torch.int64, device=device)
    cols = torch.minimum(first_block_t[:, None] + torch.arange(nb, device=device), last_block_t[:, None])
    tables = md.block_tables if len(seqs) == md.num_seqs else md.block_tables[torch.tensor(seqs, device=device)]
    block_ids = tables.long().gather(1, cols).reshape(-1)
    key_pos = first_block_t[:, None] * bs + torch.arange(nb * bs, device=device)
    lo = torch.tensor(first_keys, device=device)[:, None]
    hi = torch.tensor(seq_lens, device=device)[:, None]
    key_mask = ((key_pos >= lo) & (key_pos < hi))[:, None, None, :]
    rows = None
    if seqs != list(range(md.num_seqs)):
        rows = torch.tensor([md.query_start_loc[s] for s in seqs], dtype=torch.int64, device=device)
    # [Sd, 1, L] broadcasts over the [KVH, Sd, G, L] scores.
    key_bias = torch.zeros(key_mask.shape, dtype=torch.float32, device=device).masked_fill_(
        ~key_mask, float("-inf")).view(len(seqs), 1, -1)
    return DecodePlan(rows=rows, block_ids=block_ids, num_blocks=nb, key_mask=key_mask, key_bias=key_bias)


def _attend(
    q: torch.Tensor,  # [..., H, Tq, D]
    k: torch.Tensor,  # [..., KVH, Tk, D]
    v: torch.Tensor,
    mask: Optional[torch.Tensor],  # bool, broadcastable to [..., H, Tq, Tk]; True = visible
    scale: float,
    logit_softcap: Optional[float],
    is_causal: bool = False,
) -> torch.Tensor:
    if logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3]
        )
    # SDPA has no soft-capping: the explicit form (Gemma 2 style tanh cap on the scores).
    group = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if is_causal:
        tq, tk = scores.shape[-2:]
        mask = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tq, device=q.device)[:, None]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1).to(v.dtype) @ v


def _decode_attention(
    q: torch.Tensor, kv: LayerKV, plan: DecodePlan, scale: float, logit_softcap: Optional[float]
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv.num_kv_heads
    dtype = kv.compute_dtype(q.dtype)
    # Every sequence's visible blocks, padded to the longest: [KVH, Sd, L, D].
    keys = kv.gather_keys(plan.block_ids, dtype).view(num_kv_heads, num_seqs, -1, head_dim)
    values = kv.gather_values(plan.block_ids, dtype).view(num_kv_heads, num_seqs, -1, head_dim)
    # The query heads sharing a KV head become that head's "query rows": GQA without copying K/V.
    group = num_heads // num_kv_heads
    grouped = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).to(keys.dtype)
    # One query per sequence: two small batched matmuls in the cache's dtype beat SDPA's
    # flash kernel here (it is built for long query blocks); scores and softmax stay fp32.
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # [KVH, Sd, G, L]
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    probs = (scores + plan.key_bias).softmax(dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [KVH, Sd, G, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _prefill_attention(
    q: torch.Tensor,  # [n, H, D] this sequence's new tokens
    k: torch.Tensor,  # [n, KVH, D]
    v: torch.Tensor,
    kv: LayerKV,
    md: AttentionMetadata,
    seq: int,
    scale: float,
    window: Optional[int],
    logit_softcap: Optional[float],
) -> torch.Tensor:
    context = md.context_lens[seq]
    seq_len = md.seq_lens[seq]
    device = q.device
    out_dtype, q = q.dtype, q.to(kv.compute_dtype(q.dtype))
    if context == 0 and not kv.is_quantized:
        # Nothing cached before this chunk: its own keys are all there is to see (an int8
        # cache reads them back quantized, as every later step will see them).
        keys, values, first_key = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype), 0
    else:
        bs = md.block_size
        # First key any of these queries can see; blocks before it are not read.
        first_visible = max(0, context - window + 1) if window else 0
        first_block = first_visible // bs
        block_ids = md.block_tables[seq, first_block:(seq_len - 1) // bs + 1].long()
        first_key = first_block * bs
        num_keys = seq_len - first_key
        keys = kv.gather_keys(block_ids, q.dtype)[:, :num_keys]
        values = kv.gather_values(block_ids, q.dtype)[:, :num_keys]

    mask = None
    is_causal = context == 0 and window is None
    if not is_causal:
        # Causal (+ window) mask from position comparisons, never a materialised tril(ones).
        q_pos = torch.arange(context, seq_len, device=device)[:, None]
        k_pos = torch.arange(first_key, seq_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= (q_pos - k_pos) < window
    out = _attend(q.transpose(0, 1)[None], keys[None], values[None], mask, scale, logit_softcap, is_causal)
    return out[0].transpose(0, 1).to(out_dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: LayerKV,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int],
    logit_softcap: Optional[float] = None,
) -> torch.Tensor:
    """Paged attention: ``q [T, H, D]``, ``k, v [T, KVH, D]`` -> ``[T, H, D]``.

    Writes this step's k/v into the layer's cache ``kv`` at ``slot_mapping`` first, then each sequence's
    queries (positions ``context_len .. seq_len-1``) attend causally over its cached keys
    ``0 .. seq_len-1``; with ``sliding_window`` W, query i sees key j iff ``i - W < j <= i``
    (HF Gemma 3 / Mistral semantics). fp32 queries on the CPU take the fused kernel
    (kvserve/csrc): one call for the whole step, prefill chunks and decodes, reading the blocks
    in place. Otherwise plain torch: decode sequences gathered and batched into two matmuls,
    prefill chunks one SDPA each.
    """
    # One profiler label over the whole of attention (cache write included): `kvserve profile`
    # attributes time to it.
    with label("attention"):
        attn_metadata = attn_metadata.for_group(kv.group)
        kv.write(k, v, attn_metadata.slot_mapping)
        if ops.enabled_for(q):
            return _kernel_attention(q, kv, attn_metadata, scale, sliding_window, logit_softcap)
        return _torch_attention(q, k, v, kv, attn_metadata, scale, sliding_window, logit_softcap)


def _kernel_attention(q: torch.Tensor, kv: LayerKV, md: AttentionMetadata, scale: float,
                      window: Optional[int], logit_softcap: Optional[float]) -> torch.Tensor:
    out = torch.empty_like(q)
    ops.paged_attention_kernel(out, q, kv.data, kv.scales, md.block_tables, md.seq_lens_tensor, *kernel_rows(md),
                               scale, window, logit_softcap)
    return out


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                     md: AttentionMetadata, scale: float, window: Optional[int],
                     logit_softcap: Optional[float]) -> torch.Tensor:
    plans = decode_plans(md, window)
    if len(plans) == 1 and plans[0].rows is None:
        return _decode_attention(q, kv, plans[0], scale, logit_softcap)
    out = torch.empty_like(q)
    for plan in plans:
        out.index_copy_(0, plan.rows, _decode_attention(q.index_select(0, plan.rows), kv, plan,
                                                        scale, logit_softcap))
    qsl = md.query_start_loc
    for seq, n in enumerate(md.query_lens):
        if n > 1:
            a, b = qsl[seq], qsl[seq + 1]
            out[a:b] = _prefill_attention(q[a:b], k[a:b], v[a:b], kv, md, seq, scale, window, logit_softcap)
    return out
