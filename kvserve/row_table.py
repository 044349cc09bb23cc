"""Tables read a row at a time, the token embedding and the LM head's exact weights, held as the
Q8_0 blocks they are made of.

GGUF files store both models' token embeddings as Q8_0 (an fp16 scale ``d`` per 32 int8 values
``q``), and the loader dequantizes them to fp32: ``d * q``, a product exact in fp32. Kept as
fp32 the table is the largest tensor of a Gemma 3 engine (671 MB); its blocks are 178 MB and
give every row with the same bits (``kvserve/csrc/row_table.h``). The lookup and the head's
rescoring of its top candidates read single rows, so they lose nothing by reading the blocks.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from kvserve import block_formats, ops

logger = logging.getLogger(__name__)

_FIRST_ROWS = 64  # rows tried before a whole table is quantized


class Q8Table(nn.Module):
    """An fp32 table ``[rows, K]`` as Q8_0 blocks: ``qs`` int8 ``[rows, K]``, ``d`` the fp16 bits
    (int16) of ``[rows, K / 32]`` (Q8Linear's layout, so an int4 engine's Q8_0 LM head shares
    them). Called with token ids it is the embedding lookup: their rows in fp32."""

    def __init__(self, qs: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qs", qs.contiguous())
        self.register_buffer("d", d.contiguous())

    @classmethod
    def of_exact(cls, table: torch.Tensor, blocks: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                 ) -> Optional["Q8Table"]:
        """The Q8_0 blocks that reproduce ``table`` bit for bit (``blocks`` if given and they do:
        the head's own), or None where no blocks do (a table that was not Q8_0) or the kernels
        are off."""
        if (table.dtype != torch.float32 or table.dim() != 2 or table.device.type != "cpu"
                or table.shape[1] % block_formats.GROUP or not table.is_contiguous()):
            return None
        ext = ops.load_extension()
        if ext is None:
            return None
        if blocks is None or tuple(blocks[0].shape) != tuple(table.shape) or blocks[1].dtype != torch.int16:
            # A table of other values (safetensors weights, another GGUF type) shows it in its
            # first rows: quantizing Gemma 3's whole table to find out took ~0.5 s.
            first = table[:_FIRST_ROWS]
            if not ext.q8_0_reproduces(first, *ext.q8_0_quantize(first)):
                return None
            blocks = tuple(ext.q8_0_quantize(table))
        qs, d = blocks
        return cls(qs, d) if ext.q8_0_reproduces(table, qs, d) else None

    @property
    def shape(self) -> torch.Size:
        return self.qs.shape

    def dequantized(self, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``ids`` (any shape; all rows without) in fp32: ``[*ids.shape, K]``."""
        qs, d = self.qs, self.d
        if ids is not None:  # (index_select: an id outside the table is an error, as nn.Embedding's)
            flat = ids.reshape(-1)
            qs, d = qs.index_select(0, flat), d.index_select(0, flat)
        values = torch.from_numpy(block_formats.byte_values(block_formats.ByteBlocks(qs.numpy(), d.numpy())))
        return values if ids is None else values.view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.dequantized(input_ids)


class GGUFRows(nn.Module):
    """A GGUF matrix read a row at a time from its blocks as the file stores them, in place:
    ``raw`` uint8 ``[rows, row bytes]`` (a view of the file's mapped pages: no copy, and only the
    pages of rows read are ever resident), ``ggml_type`` the GGUF type, ``in_features`` K. The
    kernels dequantize each row as they read it (csrc/ggml_rows.h), with the values
    kvserve.block_formats gives. Called with token ids it is the embedding lookup.

    ``release``: hands the rows' pages back to the file (the loader's GGUFFile.release). Rows read
    here are a cold path (embedding lookups, the LM head's rescored candidates), but each page
    read stays mapped, and the kernel maps 64 KB around each fault: a Llama-3-sized head's rows
    became ~200 MB resident in 64 decode steps of a random-weight model, on top of its repacked
    copy. ``release_pages`` (the runner calls it every MAPPED_ROWS_RELEASE_STEPS steps) keeps
    them resident only while in use."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, in_features: int,
                 release: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self.raw = raw  # (not a buffer: a mapped file is not state to save or move)
        self.ggml_type, self.in_features = int(ggml_type), int(in_features)
        self.format = torch.tensor([self.ggml_type, self.in_features], dtype=torch.int64)
        self.release = release

    def release_pages(self) -> None:
        if self.release is not None:
            self.release()

    def __getstate__(self) -> dict:
        # The release callback holds the file's mapping, which does not copy or pickle; a copy
        # reads the same rows and keeps its pages.
        return {**super().__getstate__(), "release": None}

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.in_features))

    def dequantized(self, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``ids`` (any shape; all rows without) in fp32: ``[*ids.shape, K]``."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = self.raw if ids is None else self.raw.index_select(0, ids.reshape(-1))
        values = dequantize(raw.numpy(), GGMLQuantizationType(self.ggml_type)).astype("float32", copy=False)
        values = torch.from_numpy(values.reshape(raw.shape[0], self.in_features))
        return values if ids is None else values.view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if ops.kernels_on(self.raw):  # the decoder's own lookup (row_table.h)
            rows = ops.load_extension().table_rows(self.raw, self.format, input_ids.reshape(-1).contiguous())
            return rows.view(*input_ids.shape, self.in_features)
        return self.dequantized(input_ids)


RowSource = Union[torch.Tensor, Q8Table, GGUFRows]

# How often the runner hands rows read in place back to the file (GGUFRows.release_pages): the
# pages of a step's rows come back with a minor fault each the next time they are read.
MAPPED_ROWS_RELEASE_STEPS = 8


def mapped_row_tables(model: nn.Module) -> list[GGUFRows]:
    """The model's tables read in place from its file, each once (a tied head's rows are the
    embedding's)."""
    seen: dict[int, GGUFRows] = {}
    for module in model.modules():
        if isinstance(module, GGUFRows):
            seen.setdefault(module.raw.data_ptr(), module)
    return list(seen.values())


def table_args(table: Union[nn.Module, RowSource]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What the kernels take for a table (``row_table.h``'s RowTable): (fp32 values, None) or
    (Q8_0 values, scales). ``table``: an fp32 tensor, a Q8Table, or an embedding module (its weight)."""
    if isinstance(table, Q8Table):
        return table.qs, table.d
    if isinstance(table, GGUFRows):
        return table.raw, table.format
    if isinstance(table, nn.Module):
        return table.weight, None
    return table, None


def kernels_read(table: Union[nn.Module, RowSource]) -> bool:
    """Whether the native kernels read this table (on the CPU, fp32 or Q8_0 blocks)."""
    values, scales = table_args(table)
    return ops.enabled_for(values) if scales is None else ops.kernels_on(values)


def keep_embedding_as_blocks(model: nn.Module) -> int:
    """Replace the decoder's fp32 embedding table (and the LM head's exact weights, where they are
    the same tensor) by the Q8_0 blocks that reproduce it, when some do; the bytes saved.
    ``model.lm_head`` a RescoredLMHead whose fast head may hold the blocks already (Q8_0)."""
    decoder, head = model.model, model.lm_head
    embed = getattr(decoder, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding):
        return 0  # (tensor-parallel ranks hold a shard of the table)
    weight = embed.weight
    tied = getattr(head, "exact_weight", None) is weight
    fast = getattr(head, "fast", None)
    blocks = (fast.qs, fast.d) if tied and hasattr(fast, "qs") else None
    table = Q8Table.of_exact(weight, blocks)
    if table is None:
        return 0
    decoder.embed_tokens = table
    if tied:
        del head.exact_weight  # (a Parameter: a module cannot take its place while it is registered)
        head.exact_weight = table
    shared = blocks is not None and table.qs is blocks[0]
    kept = 0 if shared else sum(b.numel() * b.element_size() for b in (table.qs, table.d))
    saved = weight.numel() * weight.element_size() - kept
    logger.info("token embedding kept as its Q8_0 blocks%s: %.1f MiB less",
                " (the LM head's)" if shared else "", saved / 2**20)
    return saved


def gathered_rows_dot(x: torch.Tensor, w: Any, idx: torch.Tensor) -> torch.Tensor:
    """``out[s, j] = x[s] . w[idx[s, j]]`` (the LM head's rescoring of its top candidates), ``w``
    an fp32 table or a Q8Table (its rows, the same values). The kernel sums
    each dot product in Fp32Linear's order whatever the number of rows; ``torch.bmm`` (the
    reference) picks its kernel by the batch."""
    values, scales = table_args(w)
    if (ops.enabled_for(x) and x.dim() == 2 and x.stride(-1) == 1 and values.stride(-1) == 1
            and (scales is not None or values.dtype == torch.float32)):
        return ops.load_extension().gathered_rows_dot(x, values, idx.contiguous(), scales)
    return gathered_rows_dot_reference(x, w, idx)


def gathered_rows_dot_reference(x: torch.Tensor, w: Any, idx: torch.Tensor) -> torch.Tensor:
    flat = idx.reshape(-1)
    rows = (w.index_select(0, flat) if isinstance(w, torch.Tensor) else w.dequantized(flat)).view(*idx.shape, -1)
    return torch.bmm(rows.float(), x.float().unsqueeze(-1)).squeeze(-1)
