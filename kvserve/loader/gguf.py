"""GGUF -> kvserve: metadata to ``ModelConfig``, tensors to HF-named weights.

Each architecture declares how llama.cpp's converter writes it (models/<arch>.py's
GGUF_LAYOUTS, models/gguf_layout.py): its tensor names, its own metadata (a hook), and what the
file changes relative to the HF checkpoint, undone here:
- llama's ``attn_q`` / ``attn_k`` rows are permuted (per head, the two rotary halves
  interleaved) for llama.cpp's rope layout; we put them back so HF-style ``rotate_half`` rope
  works.
- Gemma 3's norms are stored as ``1 + w``; the model (like HF) computes ``x * (1 + w)``, so we
  subtract 1.
- MoE: each HF expert matrix is a slice of a 3-D expert stack (``TensorRef.expert``), read in
  place; DeepSeek's split ``attn_k_b`` / ``attn_v_b`` are put back together as kv_b_proj.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve import block_formats
from kvserve.block_formats import QuantizedTensor
from kvserve.config import ConfigError, ModelConfig
from kvserve.loader.gguf_reader import GGUFFile
from kvserve.models.gguf_layout import ROPE_FREQS_TENSOR
from kvserve.models.registry import GGUF_LAYOUTS, get_gguf_layout

Q = GGMLQuantizationType
SUPPORTED_QUANT_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
})

_COMMON_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class TensorRef:
    """Where an HF weight is in the file: a tensor (``name``), one expert's matrix of a 3-D
    expert stack (``expert``), or DeepSeek's kv_b_proj split into its key halves (``name``,
    attn_k_b) and value halves (``value_half``, attn_v_b)."""

    name: str
    expert: Optional[int] = None
    value_half: Optional[str] = None


def _ref(ref: "TensorRef | str") -> TensorRef:
    return ref if isinstance(ref, TensorRef) else TensorRef(ref)


class FileMetadata:
    """A GGUF file as an architecture's hook reads it (models/gguf_layout.GGUFMetadata)."""

    def __init__(self, gf: GGUFFile) -> None:
        self.gf, self.path = gf, gf.path

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{self.gf.architecture}.{key}"
        if full not in self.gf.metadata:
            if required:
                raise ConfigError(f"{self.path}: GGUF metadata lacks '{full}'")
            return default
        return self.gf.metadata[full]

    def has_tensor(self, name: str) -> bool:
        return name in self.gf.tensors

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.gf.tensors[name].shape)

    def tensor_floats(self, name: str) -> list[float]:
        return [float(x) for x in dequantize(self.gf.raw(name), self.gf.tensors[name].quant_type).ravel()]


def open_gguf(path: str) -> GGUFFile:
    """Open and validate a GGUF file: readable, complete, a supported architecture and
    supported tensor types. Raises ``ConfigError`` naming the problem.

    An engine's start-up opens its file several times (resolving the model, its config, its
    weights, a draft's): the header is parsed once per file version and process (Gemma 3's
    262k-token vocabulary: ~0.35 s a parse). The GGUFFile is shared: read it, never change it."""
    try:
        stat = os.stat(path)
    except OSError as e:
        raise ConfigError(f"cannot open model file {path}: {e.strerror}") from None
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    gf = _OPENED.pop(key, None)
    if gf is None:
        gf = _validated(path)
    _OPENED[key] = gf  # (the most recently used last)
    while len(_OPENED) > _MAX_OPENED:
        _OPENED.pop(next(iter(_OPENED)), None)
    return gf


_OPENED: dict[tuple, GGUFFile] = {}  # by (real path, size, mtime, inode), least recently used first
_MAX_OPENED = 4


def _validated(path: str) -> GGUFFile:
    gf = GGUFFile(path)
    get_gguf_layout(gf.architecture, path)
    for info in gf.tensors.values():
        if info.quant_type not in SUPPORTED_QUANT_TYPES:
            raise ConfigError(f"{path}: unsupported quant type {info.quant_type.name} (tensor '{info.name}')")
    return gf


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    """The model's configuration from the file's metadata: the keys every architecture writes
    here, the architecture's own in its layout's hook (models/<arch>.py)."""
    layout = get_gguf_layout(gf.architecture, gf.path)
    meta = FileMetadata(gf)
    md = gf.metadata
    hidden = int(meta.get("embedding_length", required=True))
    n_heads = int(meta.get("attention.head_count", required=True))
    n_layers = int(meta.get("block_count", required=True))
    head_dim = int(meta.get("attention.key_length", hidden // n_heads))
    rope_dims = meta.get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim and not layout.rope_by_adapt:
        raise ConfigError(f"{gf.path}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    if "token_embd.weight" not in gf.tensors:
        raise ConfigError(f"{gf.path}: GGUF has no token_embd.weight")
    # The embedding matrix is the truth about the vocabulary size (metadata may lack it).
    vocab = gf.tensors["token_embd.weight"].shape[0]

    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in md and int(md[key]) not in eos_ids:
            eos_ids.append(int(md[key]))
    bos = md.get("tokenizer.ggml.bos_token_id")

    config = ModelConfig(
        architecture=layout.architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta.get("feed_forward_length", required=True)),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(meta.get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get("context_length", 2048)),
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        rope_scaling=None if layout.rope_by_adapt else _rope_scaling(gf, head_dim),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        hidden_act="silu",
        final_logit_softcapping=meta.get("final_logit_softcapping"),
        attn_logit_softcapping=meta.get("attn_logit_softcapping"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        name=str(md.get("general.name", "")),
    )
    window = meta.get("attention.sliding_window")
    if window:
        config.sliding_window = int(window)
        config.layer_types = ["sliding_attention"] * n_layers
    # (Phi-3's intermediate size is half of ffn_up's rows: the file's feed_forward_length is
    # the MLP width, as HF's intermediate_size.)
    if layout.adapt is not None:
        layout.adapt(meta, config)
    return config


def _rope_scaling(gf: GGUFFile, head_dim: int) -> Optional[dict]:
    if ROPE_FREQS_TENSOR in gf.tensors:
        factors = dequantize(gf.raw(ROPE_FREQS_TENSOR), gf.tensors[ROPE_FREQS_TENSOR].quant_type)
        if factors.size != head_dim // 2:
            raise ConfigError(f"{gf.path}: {ROPE_FREQS_TENSOR} has {factors.size} entries, expected {head_dim // 2}")
        return {"rope_type": "freq_factors", "freq_factors": [float(x) for x in factors.ravel()]}
    meta = FileMetadata(gf)
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.get("rope.scaling.factor", required=True))}
    raise ConfigError(f"{gf.path}: unsupported rope scaling '{kind}'")


def gguf_to_hf_names(gf: GGUFFile, gguf_name: str) -> Optional[list[tuple[str, TensorRef]]]:
    """The HF parameters a GGUF tensor holds and where each is in it (one per expert of a 3-D
    expert stack; none for attn_v_b, read with attn_k_b), or None when the tensor is not a
    model weight of the file's architecture."""
    if gguf_name in _COMMON_NAMES:
        return [(_COMMON_NAMES[gguf_name], TensorRef(gguf_name))]
    m = _BLOCK_TENSOR.match(gguf_name)
    if m is None:
        return None
    layout = GGUF_LAYOUTS[gf.architecture]
    layer, tensor, suffix = m.groups()
    prefix = f"model.layers.{layer}."
    if f"{tensor}.{suffix}" in layout.block_names:  # (an HF parameter without the usual suffix)
        return [(prefix + layout.block_names[f"{tensor}.{suffix}"], TensorRef(gguf_name))]
    if tensor in layout.expert_names:
        module = layout.expert_names[tensor]
        return [(f"{prefix}{module.format(e=e)}.{suffix}", TensorRef(gguf_name, expert=e))
                for e in range(gf.tensors[gguf_name].shape[0])]
    split = layout.kv_b_split
    if split is not None and tensor == split[1]:
        return []  # (read with its key halves)
    if tensor not in layout.block_names:
        return None
    ref = TensorRef(gguf_name)
    if split is not None and tensor == split[0]:
        value_half = f"blk.{layer}.{split[1]}.{suffix}"
        if value_half not in gf.tensors:
            raise ConfigError(f"{gf.path}: '{gguf_name}' without its '{value_half}'")
        ref = TensorRef(gguf_name, value_half=value_half)
    return [(f"{prefix}{layout.block_names[tensor]}.{suffix}", ref)]


def hf_to_gguf_names(gf: GGUFFile, config: ModelConfig) -> dict[str, TensorRef]:
    """HF parameter name -> where it is in the file, for every model weight in the file."""
    out = {}
    config_tensors = GGUF_LAYOUTS[gf.architecture].config_tensors | {ROPE_FREQS_TENSOR}
    for gguf_name in gf.tensors:
        if gguf_name in config_tensors:
            continue  # folded into config.rope_scaling
        names = gguf_to_hf_names(gf, gguf_name)
        if names is None:
            raise ConfigError(f"{gf.path}: unexpected tensor '{gguf_name}' for architecture '{gf.architecture}'")
        out.update(names)
    return out


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf = gguf[rows]``.

    llama.cpp stores, per head, row ``2*i + j`` = HF row ``j*half + i`` (interleaved halves).
    """
    half = n_rows // n_heads // 2
    return np.arange(n_rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(-1)


def row_order_of(gguf_arch: str, gguf_name: str, config: ModelConfig, n_rows: int) -> Optional[np.ndarray]:
    """The row order that gives the HF layout of tensor ``gguf_name`` (None: as stored)."""
    if not GGUF_LAYOUTS[gguf_arch].permuted_qk:
        return None
    if ".attn_q." in gguf_name:
        return unpermute_rows(n_rows, config.num_attention_heads)
    if ".attn_k." in gguf_name:
        return unpermute_rows(n_rows, config.num_key_value_heads)
    return None


def dequantize_tensor(raw: np.ndarray, quant_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """A GGUF tensor's values as float32 ``shape`` (a view of ``raw`` for F32 tensors).

    The formats the kernels read are unpacked by kvserve.block_formats and scaled with torch
    (one output buffer, both threads): gguf's numpy dequantization took 4.5-7 s of Gemma 3's
    10-20 s start-up for its Q8_0 token embedding alone (168 M weights), ~0.5 s this way. The
    same fp32 operations (an exact product, then the offset), so the same bits as gguf's
    (tests/test_block_formats.py); other types go through gguf."""
    blocks = block_formats.unpack(quant_type.name, raw, shape) if len(shape) == 2 else None
    if blocks is None:
        return dequantize(raw, quant_type).reshape(shape)
    n, k = shape
    if isinstance(blocks, block_formats.NibbleBlocks):
        q = torch.from_numpy(blocks.q).view(n, -1, block_formats.GROUP)
        d, m = torch.from_numpy(blocks.d)[..., None], torch.from_numpy(blocks.m)[..., None]
        return torch.mul(q, d).add_(m).view(n, k).numpy()
    if isinstance(blocks, block_formats.Q5Blocks):
        codes = torch.from_numpy(block_formats.q5_codes(blocks))  # [n, groups, 32], padded to 64
        d = torch.from_numpy(blocks.d.view(np.float16)).float()[..., None]
        return torch.mul(codes, d).view(n, -1)[:, :k].contiguous().numpy()
    q = torch.from_numpy(blocks.q).view(n, -1, blocks.group)
    return torch.mul(q, torch.from_numpy(blocks.scales)[..., None]).view(n, k).numpy()


def _stored(gf: GGUFFile, ref: TensorRef) -> tuple[np.ndarray, tuple[int, ...]]:
    """(the bytes as stored, the shape of their values): a tensor, or one expert's matrix."""
    raw, shape = gf.raw(ref.name), tuple(gf.tensors[ref.name].shape)
    if ref.expert is not None:
        return raw[ref.expert], shape[1:]
    return raw, shape


def _kv_b_values(gf: GGUFFile, ref: TensorRef) -> np.ndarray:
    """kv_b_proj ``[heads * (nope + v), rank]`` from attn_k_b ``[heads, rank, nope]`` (each
    head's key half, transposed) and attn_v_b ``[heads, v, rank]``."""
    parts = []
    for name in (ref.name, ref.value_half):
        info = gf.tensors[name]
        parts.append(dequantize_tensor(gf.raw(name), info.quant_type, tuple(info.shape)))
    keys, values = parts
    if keys.ndim != 3 or values.ndim != 3 or keys.shape[1] != values.shape[2]:
        raise ConfigError(f"{gf.path}: '{ref.name}' {keys.shape} and '{ref.value_half}' {values.shape} "
                          f"are not [heads, rank, nope] and [heads, v, rank]")
    per_head = np.concatenate([keys.transpose(0, 2, 1), values], axis=1)
    return per_head.reshape(-1, per_head.shape[-1])


def tensor_values(gf: GGUFFile, config: ModelConfig, ref: TensorRef | str) -> torch.Tensor:
    """A weight's values as a float32 CPU tensor of its own: dequantized, un-permuted, Gemma's
    norms without their +1 (``ref``: a TensorRef, or a tensor's name)."""
    ref = _ref(ref)
    if ref.value_half is not None:
        values = _kv_b_values(gf, ref)
    else:
        raw, shape = _stored(gf, ref)
        values = dequantize_tensor(raw, gf.tensors[ref.name].quant_type, shape)
        rows = row_order_of(gf.architecture, ref.name, config, shape[0])
        if rows is not None:
            values = values[rows]
    if GGUF_LAYOUTS[gf.architecture].norms_plus_one and ref.name.endswith("norm.weight"):
        values = values - 1.0
    if not values.flags.writeable:  # a zero-copy view of the mapped file (F32 tensors)
        values = values.copy()
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def quantized_tensor(gf: GGUFFile, config: ModelConfig, ref: TensorRef | str) -> QuantizedTensor:
    """A block-quantized matrix as stored (an expert's: its slice of the stack, in place), its
    rows in HF order."""
    ref = _ref(ref)
    if ref.value_half is not None:
        raise ValueError(f"{ref.name}: kv_b_proj's split halves are read as values, not blocks")
    data, shape = _stored(gf, ref)
    rows = row_order_of(gf.architecture, ref.name, config, shape[0])
    return QuantizedTensor(gf.tensors[ref.name].quant_type, data[rows] if rows is not None else data, shape)


def release(gf: GGUFFile, ref: TensorRef | str) -> None:
    """Hand back the mapped pages a weight was read from (GGUFFile.release): an expert's
    matrix only its own slice of the stack."""
    ref = _ref(ref)
    if ref.expert is not None:
        info = gf.tensors[ref.name]
        size = info.nbytes // info.shape[0]
        gf.release(ref.name, ref.expert * size, (ref.expert + 1) * size)
        return
    gf.release(ref.name)
    if ref.value_half is not None:
        gf.release(ref.value_half)


def quant_type_of(gf: GGUFFile, ref: TensorRef | str) -> GGMLQuantizationType:
    return gf.tensors[_ref(ref).name].quant_type


def iter_gguf_weights(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 CPU tensor)`` one at a time, dequantized and un-permuted."""
    for hf_name, ref in hf_to_gguf_names(gf, config).items():
        yield hf_name, tensor_values(gf, config, ref)


def quantized_weights(gf: GGUFFile, config: ModelConfig) -> dict[str, QuantizedTensor]:
    """HF name -> raw quantized tensor, for every quantized (non-float) matrix in the file."""
    return {hf_name: quantized_tensor(gf, config, ref)
            for hf_name, ref in hf_to_gguf_names(gf, config).items()
            if ref.value_half is None and quant_type_of(gf, ref) not in (Q.F32, Q.F16, Q.BF16)}
