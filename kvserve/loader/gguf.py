"""GGUF -> kvserve: metadata to ``ModelConfig``, tensors to HF-named weights.

llama.cpp's converter changes two things relative to the HF checkpoint, undone here:
- ``llama`` arch: the rows of ``attn_q`` / ``attn_k`` are permuted (per head, the two rotary
  halves are interleaved) for llama.cpp's rope layout. We put them back so HF-style
  ``rotate_half`` rope works. ``qwen2`` and ``gemma3`` files are not permuted.
- ``gemma3``: every ``*norm.weight`` is stored as ``1 + w``; the model (like HF) computes
  ``x * (1 + w)``, so we subtract 1.
Some Gemma 3 hyper-parameters are not in the file at all and are llama.cpp constants:
local rope base 10000, a sliding/global pattern of 6, attention scale ``head_dim ** -0.5``
(except 27B).
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterator, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve import block_formats
from kvserve.block_formats import QuantizedTensor
from kvserve.config import ConfigError, ModelConfig
from kvserve.loader.gguf_reader import GGUFFile

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
_BLOCK_NAMES_LLAMA = {
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
_BLOCK_NAMES_GEMMA3 = {
    **_BLOCK_NAMES_LLAMA,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAMES_QWEN3 = {
    **_BLOCK_NAMES_LLAMA,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Phi-3: llama.cpp keeps the checkpoint's fused tensors, q/k/v rows in ``attn_qkv`` and gate
# then up rows in ``ffn_up`` (its SwiGLU takes the first half as the gate): kvserve's phi3
# model holds them fused under HF's names, so they load as they are.
_BLOCK_NAMES_PHI3 = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGUF architecture -> (kvserve architecture, per-block tensor names, q/k rows permuted?)
# (qwen3 and phi3 use NEOX-style rope in llama.cpp: their q/k rows are stored as HF's.)
GGUF_ARCHITECTURES: dict[str, tuple[str, dict[str, str], bool]] = {
    "llama": ("llama", _BLOCK_NAMES_LLAMA, True),
    "qwen2": ("qwen2", _BLOCK_NAMES_LLAMA, False),
    "qwen3": ("qwen3", _BLOCK_NAMES_QWEN3, False),
    "phi3": ("phi3", _BLOCK_NAMES_PHI3, False),
    "gemma3": ("gemma3", _BLOCK_NAMES_GEMMA3, False),
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# llama.cpp's llama3 rope: per-frequency divisors, stored as a tensor rather than metadata.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


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
    arch = gf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{path}: unsupported architecture '{arch}' (supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    for info in gf.tensors.values():
        if info.quant_type not in SUPPORTED_QUANT_TYPES:
            raise ConfigError(f"{path}: unsupported quant type {info.quant_type.name} (tensor '{info.name}')")
    return gf


def _meta(gf: GGUFFile, key: str, default: Any = None, required: bool = False) -> Any:
    full = f"{gf.architecture}.{key}"
    if full not in gf.metadata:
        if required:
            raise ConfigError(f"{gf.path}: GGUF metadata lacks '{full}'")
        return default
    return gf.metadata[full]


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    gguf_arch = gf.architecture
    arch = GGUF_ARCHITECTURES[gguf_arch][0]
    md = gf.metadata
    hidden = int(_meta(gf, "embedding_length", required=True))
    n_heads = int(_meta(gf, "attention.head_count", required=True))
    n_layers = int(_meta(gf, "block_count", required=True))
    head_dim = int(_meta(gf, "attention.key_length", hidden // n_heads))
    rope_dims = _meta(gf, "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
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
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_meta(gf, "feed_forward_length", required=True)),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(_meta(gf, "attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(_meta(gf, "context_length", 2048)),
        rms_norm_eps=float(_meta(gf, "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_meta(gf, "rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gf, head_dim),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        hidden_act="silu",
        final_logit_softcapping=_meta(gf, "final_logit_softcapping"),
        attn_logit_softcapping=_meta(gf, "attn_logit_softcapping"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        name=str(md.get("general.name", "")),
    )
    window = _meta(gf, "attention.sliding_window")
    if arch == "gemma3":
        config.hidden_act = "gelu_pytorch_tanh"
        config.rope_local_base_freq = 10000.0
        config.sliding_window = int(window) if window else None
        config.layer_types = _gemma3_layer_types(gf, n_layers)
        # llama.cpp: 27B (62 layers) scales by (hidden / heads) ** -0.5, the others by head_dim ** -0.5.
        config.query_pre_attn_scalar = float(hidden // n_heads if n_layers == 62 else head_dim)
    elif window:
        config.sliding_window = int(window)
        config.layer_types = ["sliding_attention"] * n_layers
    if arch == "phi3":
        # The 128k variants' LongRoPE factors are tensors (rope_factors_long/short), which
        # these tables do not map yet: refused here rather than run with the wrong rope.
        if any(name.startswith("rope_factors_") for name in gf.tensors):
            raise ConfigError(f"{gf.path}: phi3 LongRoPE GGUF files are not supported yet (load the HF directory)")
        # (Phi-3's intermediate size is half of ffn_up's rows: the file's feed_forward_length
        # is the MLP width, as HF's intermediate_size.)
    return config


def _gemma3_layer_types(gf: GGUFFile, n_layers: int) -> list[str]:
    pattern = _meta(gf, "attention.sliding_window_pattern")
    if pattern is not None and np.ndim(pattern) == 1:  # newer files: one bool per layer
        return ["sliding_attention" if p else "full_attention" for p in list(pattern)]
    period = int(pattern) if pattern is not None else 6
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def _rope_scaling(gf: GGUFFile, head_dim: int) -> Optional[dict]:
    if ROPE_FREQS_TENSOR in gf.tensors:
        factors = dequantize(gf.raw(ROPE_FREQS_TENSOR), gf.tensors[ROPE_FREQS_TENSOR].quant_type)
        if factors.size != head_dim // 2:
            raise ConfigError(f"{gf.path}: {ROPE_FREQS_TENSOR} has {factors.size} entries, expected {head_dim // 2}")
        return {"rope_type": "freq_factors", "freq_factors": [float(x) for x in factors.ravel()]}
    kind = _meta(gf, "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_meta(gf, "rope.scaling.factor", required=True))}
    raise ConfigError(f"{gf.path}: unsupported rope scaling '{kind}'")


def gguf_to_hf_name(gguf_arch: str, gguf_name: str) -> Optional[str]:
    """HF parameter name of a GGUF tensor, or None when the tensor is not a model weight."""
    if gguf_name in _COMMON_NAMES:
        return _COMMON_NAMES[gguf_name]
    m = _BLOCK_TENSOR.match(gguf_name)
    block_names = GGUF_ARCHITECTURES[gguf_arch][1]
    if m is None or m.group(2) not in block_names:
        return None
    return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"


def hf_to_gguf_names(gf: GGUFFile, config: ModelConfig) -> dict[str, str]:
    """HF parameter name -> the file's tensor name, for every model weight in the file."""
    out = {}
    for gguf_name in gf.tensors:
        if gguf_name == ROPE_FREQS_TENSOR:
            continue  # folded into config.rope_scaling
        hf_name = gguf_to_hf_name(gf.architecture, gguf_name)
        if hf_name is None:
            raise ConfigError(f"{gf.path}: unexpected tensor '{gguf_name}' for architecture '{gf.architecture}'")
        out[hf_name] = gguf_name
    return out


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: ``hf = gguf[rows]``.

    llama.cpp stores, per head, row ``2*i + j`` = HF row ``j*half + i`` (interleaved halves).
    """
    half = n_rows // n_heads // 2
    return np.arange(n_rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(-1)


def row_order_of(gguf_arch: str, gguf_name: str, config: ModelConfig, n_rows: int) -> Optional[np.ndarray]:
    """The row order that gives the HF layout of tensor ``gguf_name`` (None: as stored)."""
    if not GGUF_ARCHITECTURES[gguf_arch][2]:
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


def tensor_values(gf: GGUFFile, config: ModelConfig, gguf_name: str) -> torch.Tensor:
    """A tensor's values as a float32 CPU tensor of its own: dequantized, un-permuted, Gemma's
    norms without their +1."""
    info = gf.tensors[gguf_name]
    values = dequantize_tensor(gf.raw(gguf_name), info.quant_type, tuple(info.shape))
    rows = row_order_of(gf.architecture, gguf_name, config, info.shape[0])
    if rows is not None:
        values = values[rows]
    if gf.architecture == "gemma3" and gguf_name.endswith("norm.weight"):
        values = values - 1.0
    if not values.flags.writeable:  # a zero-copy view of the mapped file (F32 tensors)
        values = values.copy()
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def quantized_tensor(gf: GGUFFile, config: ModelConfig, gguf_name: str) -> QuantizedTensor:
    """A block-quantized tensor as stored, its rows in HF order."""
    info = gf.tensors[gguf_name]
    data = gf.raw(gguf_name)
    rows = row_order_of(gf.architecture, gguf_name, config, info.shape[0])
    return QuantizedTensor(info.quant_type, data[rows] if rows is not None else data, info.shape)


def iter_gguf_weights(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 CPU tensor)`` one at a time, dequantized and un-permuted."""
    for hf_name, gguf_name in hf_to_gguf_names(gf, config).items():
        yield hf_name, tensor_values(gf, config, gguf_name)


def quantized_weights(gf: GGUFFile, config: ModelConfig) -> dict[str, QuantizedTensor]:
    """HF name -> raw quantized tensor, for every quantized (non-float) matrix in the file."""
    return {hf_name: quantized_tensor(gf, config, gguf_name)
            for hf_name, gguf_name in hf_to_gguf_names(gf, config).items()
            if gf.tensors[gguf_name].quant_type not in (Q.F32, Q.F16, Q.BF16)}
