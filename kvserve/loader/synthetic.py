"""Random-weight GGUF files of real models' shapes, for benchmarks and tests.

A decode step's time and an engine's memory depend on a model's shapes and weight formats, not
on its values: a file with Llama-3.2-1B's exact shapes, quantized to Q4_K_M, measures what the
real one would. ``synthetic:<shape>:<format>`` (e.g. ``synthetic:llama-1b:Q4_K_M``) names such a
file anywhere a model is named; it is written once into the cache directory and reused.

Where llama.cpp's Python binding is installed (the ``llamacpp`` extra), the file is an F16 file
of random values quantized by llama.cpp's own ``llama_model_quantize``: its mix of formats per
tensor (Q4_K_M's Q6_K layers) is llama.cpp's. Without it, the blocks themselves are random
bytes (every byte pattern is a valid block) with scales that keep activations finite, in the
same per-tensor mix (``_mix_type``, llama.cpp's rules for the formats here). The tokenizer is
SmolLM2's, padded with unused tokens to the shape's vocabulary, so prompts tokenize as usual.
"""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType

from kvserve import environment
from kvserve.errors import ConfigError
from kvserve.loader.gguf_reader import GGUFFile

Q = GGMLQuantizationType


@dataclass(frozen=True)
class SyntheticShape:
    """A model's shape as its GGUF states it (llama.cpp's ``llama`` or ``qwen2`` architecture)."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0
    arch: str = "llama"  # qwen2: q/k/v biases
    context: int = 8192


SHAPES: dict[str, SyntheticShape] = {s.name: s for s in (
    SyntheticShape("llama-1b", 16, 2048, 8192, 32, 8, 128256, tied=True),  # Llama-3.2-1B
    SyntheticShape("llama-3b", 28, 3072, 8192, 24, 8, 128256, tied=True),  # Llama-3.2-3B
    SyntheticShape("llama-8b", 32, 4096, 14336, 32, 8, 128256, tied=False),  # Llama-3.1-8B
    SyntheticShape("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, 151936, tied=True, rope_theta=1e6, arch="qwen2"),
    # For tests: every projection a multiple of 256 (the K-quants' super-block), two layers.
    SyntheticShape("tiny", 2, 256, 512, 4, 2, 49152, tied=True),
    SyntheticShape("tiny-untied", 2, 256, 768, 4, 1, 49152, tied=False),
)}

# llama.cpp's file types (llama_ftype) for the formats a synthetic file can take.
FILE_TYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
_BASE_TYPE = {"Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q8_0": Q.Q8_0, "Q5_0": Q.Q5_0, "Q4_K_M": Q.Q4_K,
              "Q5_K_M": Q.Q5_K, "Q6_K": Q.Q6_K}
SPEC = re.compile(r"^synthetic:([\w.\-]+):(\w+)$")
_WEIGHT_STD = 0.02


def parse_spec(spec: str) -> Optional[tuple[SyntheticShape, str]]:
    """``synthetic:<shape>:<format>`` -> (shape, format); None for any other spec. Raises
    ConfigError for an unknown shape or format."""
    m = SPEC.match(spec)
    if m is None:
        return None
    shape, fmt = m.group(1), m.group(2).upper()
    if shape not in SHAPES:
        raise ConfigError(f"unknown synthetic shape '{shape}' (known: {', '.join(SHAPES)})")
    if fmt not in FILE_TYPES:
        raise ConfigError(f"unknown synthetic format '{m.group(2)}' (known: {', '.join(FILE_TYPES)})")
    return SHAPES[shape], fmt


def synthetic_path(shape: SyntheticShape, fmt: str, tokenizer_gguf: Path, cache_dir: Optional[Path] = None,
                   use_llama_cpp: Optional[bool] = None) -> Path:
    """The file for ``shape`` in ``fmt``, written on first use (llama.cpp's quantizer where it is
    installed and ``use_llama_cpp`` is not False; random blocks otherwise), with the tokenizer
    of the GGUF file ``tokenizer_gguf``."""
    llama_cpp = _llama_cpp() if use_llama_cpp is not False else None
    if use_llama_cpp and llama_cpp is None:
        raise ConfigError("quantizing a synthetic model with llama.cpp needs llama-cpp-python (the llamacpp extra)")
    how = "llamacpp" if llama_cpp is not None else "blocks"
    root = (cache_dir or environment.cache_dir()) / "synthetic"
    out = root / f"{shape.name}.{fmt}.{how}.gguf"
    if out.is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    try:
        if llama_cpp is None:
            _write(shape, tokenizer_gguf, partial, lambda name, rows, cols: _mix_type(fmt, shape, name))
        else:
            f16 = root / f"{shape.name}.F16.{os.getpid()}.partial"
            try:
                _write(shape, tokenizer_gguf, f16, lambda name, rows, cols: Q.F16)
                _quantize(llama_cpp, f16, partial, FILE_TYPES[fmt])
            finally:
                f16.unlink(missing_ok=True)
        os.replace(partial, out)  # only a complete file is ever found
    finally:
        partial.unlink(missing_ok=True)
    return out


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def _quantize(llama_cpp, src: Path, dst: Path, ftype: int) -> None:
    quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src} (code {rc})")


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in the _M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _mix_type(fmt: str, shape: SyntheticShape, name: str) -> GGMLQuantizationType:
    """The type llama.cpp's quantizer gives tensor ``name`` in file type ``fmt`` (its rules for
    these formats, without its fallbacks for rows that do not divide into super-blocks)."""
    base = _BASE_TYPE[fmt]
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        return Q.Q8_0 if fmt == "Q8_0" else Q.Q6_K
    m = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$", name)
    if fmt in ("Q4_K_M", "Q5_K_M") and m and _use_more_bits(int(m.group(1)), shape.layers):
        return Q.Q6_K
    return base


def _tensors(shape: SyntheticShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and (rows, columns) / (length,) shape, in llama.cpp's order."""
    h, head_dim = shape.hidden, shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h)),
                (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (shape.ffn, h)), (b + "ffn_up.weight", (shape.ffn, h)),
                (b + "ffn_down.weight", (h, shape.ffn))]
        if shape.arch == "qwen2":
            out += [(b + "attn_q.bias", (h,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, h)))
    return out


def _write(shape: SyntheticShape, tokenizer_gguf: Path, path: Path, type_of) -> None:
    """Write ``shape``'s GGUF to ``path``, matrices in ``type_of(name, rows, cols)``. The values
    of every matrix are windows of one pool of random numbers (a billion fresh ones would take a
    minute to draw; the kernels cannot tell)."""
    rng = np.random.default_rng(0)
    tensors = _tensors(shape)
    largest = max(int(np.prod(s)) for _, s in tensors)
    pool = None
    writer = GGUFWriter(str(path), shape.arch)
    _add_metadata(writer, shape, tokenizer_gguf)
    for name, dims in tensors:
        if len(dims) == 1:
            values = np.ones(dims, np.float32) if name.endswith("norm.weight") else \
                rng.normal(0, _WEIGHT_STD, dims).astype(np.float32)
            writer.add_tensor(name, values)
            continue
        qtype = type_of(name, *dims)
        n = dims[0] * dims[1]
        if qtype in (Q.F16, Q.F32):
            if pool is None:
                pool = rng.normal(0, _WEIGHT_STD, largest + 4096).astype(np.float16)
            start = int(rng.integers(0, 4096))
            writer.add_tensor(name, pool[start:start + n].reshape(dims), raw_dtype=Q.F16)
        else:
            writer.add_tensor(name, random_blocks(qtype, dims, rng), raw_shape=_byte_shape(qtype, dims), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _byte_shape(qtype: GGMLQuantizationType, dims: tuple[int, int]) -> tuple[int, int]:
    block, nbytes = GGML_QUANT_SIZES[qtype]
    return dims[0], dims[1] // block * nbytes


# Where each block format keeps its fp16 scales: (offset of d, offset of dmin or None, block bytes).
_SCALE_FIELDS = {
    Q.Q4_0: (0, None), Q.Q4_1: (0, 2), Q.Q5_0: (0, None), Q.Q5_1: (0, 2), Q.Q8_0: (0, None),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None),
}


def random_blocks(qtype: GGMLQuantizationType, dims: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A ``dims`` matrix of ``qtype`` blocks with random codes and sub-scales, and super-block
    scales that keep the weights about as large as a trained model's (std ~0.02)."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rows, blocks = dims[0], dims[1] // block
    data = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    d_off, m_off = _SCALE_FIELDS[qtype]
    # The codes' spread in each format's units: 4-bit ~ +-8, 5-bit ~ +-16, 8-bit ~ +-128; the
    # K-quants' 6-bit sub-scales multiply d by up to 63 (Q6_K: signed 8-bit, up to 127).
    spread = {Q.Q8_0: 128, Q.Q5_0: 16, Q.Q5_1: 16, Q.Q4_K: 8 * 32, Q.Q5_K: 16 * 32, Q.Q6_K: 32 * 64}.get(qtype, 8)
    d = rng.uniform(0.5, 1.5, (rows, blocks)).astype(np.float32) * (_WEIGHT_STD * 1.7 / spread)
    data[..., d_off:d_off + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    if m_off is not None:  # the offset: about half the codes' range, so weights centre on zero
        data[..., m_off:m_off + 2] = (d * 8).astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * nbytes)


def _add_metadata(writer: GGUFWriter, shape: SyntheticShape, tokenizer_gguf: Path) -> None:
    head_dim = shape.hidden // shape.heads
    writer.add_name(f"synthetic {shape.name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    _add_tokenizer(writer, shape.vocab, tokenizer_gguf)


def _add_tokenizer(writer: GGUFWriter, vocab: int, tokenizer_gguf: Path) -> None:
    """The tokenizer of ``tokenizer_gguf``, padded with unused tokens up to ``vocab`` entries."""
    md = GGUFFile(str(tokenizer_gguf)).metadata
    tokens = list(md["tokenizer.ggml.tokens"])
    types = [int(t) for t in md["tokenizer.ggml.token_type"]]
    if len(tokens) > vocab:
        raise ConfigError(f"a synthetic vocabulary of {vocab} is smaller than the tokenizer's {len(tokens)}")
    tokens += [f"<unused_{i}>" for i in range(vocab - len(tokens))]
    types += [int(TokenType.UNUSED)] * (vocab - len(types))
    writer.add_tokenizer_model(str(md["tokenizer.ggml.model"]))
    writer.add_tokenizer_pre(str(md["tokenizer.ggml.pre"]))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(md["tokenizer.ggml.merges"]))
    writer.add_bos_token_id(int(md["tokenizer.ggml.bos_token_id"]))
    writer.add_eos_token_id(int(md["tokenizer.ggml.eos_token_id"]))
    writer.add_add_bos_token(False)
    writer.add_chat_template(str(md["tokenizer.chat_template"]))
