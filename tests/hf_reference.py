"""HF transformers' reference models for the real models, read from their GGUF files by
transformers' own GGUF loader, in seconds rather than tens of seconds.

transformers reads a GGUF file's metadata through ``gguf.GGUFReader``, which builds a numpy view
per array element, and does so twice per model load (the config, then the tensors): Gemma 3's
262,144-token vocabulary made one load take ~40 s, SmolLM2's ~15 s, a good part of the suite's
time on CI's two cores. A model needs none of the tokenizer's arrays. The file loaded here is a
copy that holds the original's tensor bytes as they are and every other metadata key, with the
vocabulary's size as ``<arch>.vocab_size`` (the key transformers takes the config's vocab_size
from; without it, it counts the tokens). The reference is still transformers' own reading of
the same weights and hyper-parameters, independent of kvserve's loader.

The rest of a load was transformers building gguf's tensor name map once per module of the
model (~400 of them, 6 s for SmolLM2): the same map each time, so it is built once per
(architecture, layer count) while the reference loads.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import struct
from pathlib import Path

import torch
from gguf import GGUFValueType

from kvserve.loader.gguf_reader import _Cursor
from kvserve.loader.resolve import default_cache_dir

# The tokenizer's arrays: all of the parsing time, no part of the model.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges")
_DEFAULT_ALIGNMENT = 32


def model_only_gguf(source: Path, target: Path) -> None:
    """Writes ``target``: ``source`` without TOKENIZER_ARRAYS, plus ``<arch>.vocab_size``."""
    data = source.read_bytes()
    cur = _Cursor(data)
    cur.pos = 4
    version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    kept, metadata = [], {}
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        value = cur.value(GGUFValueType(cur.scalar("<I")))
        metadata[key] = value
        if key not in TOKENIZER_ARRAYS:
            kept.append(data[start:cur.pos])
    arch = metadata["general.architecture"]
    if f"{arch}.vocab_size" not in metadata:
        key = f"{arch}.vocab_size".encode()
        kept.append(struct.pack("<Q", len(key)) + key + struct.pack("<II", GGUFValueType.UINT32,
                                                                     len(metadata["tokenizer.ggml.tokens"])))
    infos_start = cur.pos
    for _ in range(n_tensors):  # name, dims, type, offset: copied as they are
        cur.string()
        n_dims = cur.scalar("<I")
        cur.pos += 8 * n_dims + 4 + 8
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kept)) + b"".join(kept) + data[infos_start:cur.pos]
    # Tensor offsets count from the data section, which starts at the next multiple of alignment.
    head += b"\0" * (-len(head) % alignment)
    staging = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        with open(staging, "wb") as f:
            f.write(head)
            f.write(memoryview(data)[data_start:])
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


# Part of the copies' key: a change to what model_only_gguf writes must bump it.
COPY_FORMAT = 1


def model_only_copy(source: Path) -> Path:
    """The model-only copy of ``source``, made once per file version in kvserve's cache."""
    stat = source.stat()
    key = hashlib.sha256(f"{COPY_FORMAT}|{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = default_cache_dir() / "hf-reference" / f"{source.stem}-{key}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        model_only_gguf(source, target)
    return target


def hf_model_from_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' model from the GGUF file at ``path`` (its weights dequantized by
    transformers and the gguf package), in eval mode."""
    from transformers import AutoModelForCausalLM

    copy = model_only_copy(Path(path))
    with _tensor_name_maps_built_once():
        return AutoModelForCausalLM.from_pretrained(str(copy.parent), gguf_file=copy.name, dtype=dtype).eval()


@contextlib.contextmanager
def _tensor_name_maps_built_once():
    """gguf.get_tensor_name_map memoised while the block runs (transformers imports it from
    the module at each call). The maps are only read."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original
