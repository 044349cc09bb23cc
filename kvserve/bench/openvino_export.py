"""The OpenVINO peer's set-up: its virtualenv, and the model exported once per weight format.

openvino-genai and optimum-intel (whose ``optimum-cli export openvino`` writes the model)
want an older transformers than kvserve's, so they live in their own virtualenv
(``scripts/setup_openvino.sh`` makes ``.venv-openvino`` in the repository) and everything that imports them runs as that venv's python in a child process.

Export, once per model and format, into ``<cache>/openvino/`` (``KVSERVE_CACHE_DIR``):

1. a GGUF (what kvserve runs) becomes an HF directory: the venv's transformers dequantizes
   the file to fp32 and saves model and tokenizer (``openvino_worker.py hf-dir``); an HF
   directory is used as it is;
2. ``optimum-cli export openvino`` writes the OpenVINO model (with its tokenizer, which
   ``ContinuousBatchingPipeline`` loads) from that directory, in the format's weights.

Each step writes into a ``.partial`` directory renamed when complete, so a cache entry that
exists is whole. Nothing is downloaded: the children run with ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from kvserve import environment

WORKER_SCRIPT = Path(__file__).with_name("openvino_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-openvino"
SETUP_HINT = "bash scripts/setup_openvino.sh"


@dataclass(frozen=True)
class OpenVinoFormat:
    """A weight format of the exported model: its name and ``optimum-cli``'s arguments."""

    name: str
    optimum_args: tuple[str, ...]


FORMATS: dict[str, OpenVinoFormat] = {
    # Issue 63's setting: every linear layer in symmetric int4 with a scale per 64 weights
    # (--ratio 1.0: none left in int8 as NNCF's default mixed precision would).
    "int4": OpenVinoFormat("int4", ("--weight-format", "int4", "--group-size", "64", "--ratio", "1.0",
                                    "--sym")),
    "int8": OpenVinoFormat("int8", ("--weight-format", "int8")),
}


@dataclass(frozen=True)
class OpenVinoVenv:
    """The peer's virtualenv (``root``): its python and optimum-cli."""

    root: Path

    @classmethod
    def default(cls) -> "OpenVinoVenv":
        return cls(DEFAULT_VENV)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def optimum_cli(self) -> Path:
        return self.root / "bin" / "optimum-cli"

    def missing(self) -> Optional[str]:
        """Why the peer cannot run from this venv, or None."""
        for path in (self.python, self.optimum_cli):
            if not path.exists():
                return f"no OpenVINO venv at {self.root} ({path.name} missing; set it up with {SETUP_HINT})"
        return None


def child_env() -> dict[str, str]:
    """The children's environment: offline, and without this process's PYTHONPATH (a path to
    kvserve's venv would shadow the OpenVINO venv's transformers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def worker_command(venv: OpenVinoVenv, *args: str) -> list[str]:
    """``openvino_worker.py`` under the venv's python. ``-P``: the script's directory (this
    package's, where ``profile.py`` would shadow the standard library's) is not put on sys.path."""
    return [str(venv.python), "-P", str(WORKER_SCRIPT), *args]


def hf_dir_command(venv: OpenVinoVenv, gguf_path: str, out_dir: Path) -> list[str]:
    return worker_command(venv, "hf-dir", "--gguf", gguf_path, "--out", str(out_dir))


def export_command(venv: OpenVinoVenv, hf_dir: Path, fmt: OpenVinoFormat, out_dir: Path) -> list[str]:
    return [str(venv.optimum_cli), "export", "openvino", "--model", str(hf_dir),
            "--task", "text-generation-with-past", *fmt.optimum_args, str(out_dir)]


def _source_key(source_path: str) -> str:
    """The source's name, size and modification time: a changed file is exported again."""
    path = Path(source_path)
    stat = path.stat()
    return f"{path.stem if path.is_file() else path.name}-{stat.st_size}-{int(stat.st_mtime)}"


@dataclass(frozen=True)
class ExportPaths:
    """Where one source's HF directory and each format's OpenVINO model are cached."""

    source_kind: str  # "gguf" | "hf_dir"
    source_path: str
    cache_dir: Path

    @property
    def hf_dir(self) -> Path:
        if self.source_kind == "hf_dir":
            return Path(self.source_path)
        return self.cache_dir / f"{_source_key(self.source_path)}-hf"

    def model_dir(self, fmt: OpenVinoFormat) -> Path:
        return self.cache_dir / f"{_source_key(self.source_path)}-{fmt.name}"


def default_cache_dir() -> Path:
    return environment.cache_dir() / "openvino"


Runner = Callable[[list[str]], None]


def run_logged(command: list[str]) -> None:
    """Run an export step; its output goes to stderr (the bench's stdout is its report)."""
    print(f"kvserve bench: {' '.join(command)}", file=sys.stderr)
    done = subprocess.run(command, env=child_env(), stdout=sys.stderr, stderr=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} {' '.join(command[1:3])} failed with code "
                           f"{done.returncode}")


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``build(partial)`` into a fresh ``.partial`` directory, renamed to ``target`` when it
    returns: a directory found at ``target`` is always complete."""
    if target.is_dir():
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        build(partial)
        os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def ensure_exported(venv: OpenVinoVenv, paths: ExportPaths, fmt: OpenVinoFormat,
                    run: Runner = run_logged) -> Path:
    """The OpenVINO model of ``paths``' source in ``fmt``, exported on first use."""
    hf_dir = paths.hf_dir
    if paths.source_kind == "gguf":
        _build_once(hf_dir, lambda out: run(hf_dir_command(venv, paths.source_path, out)))
    return _build_once(paths.model_dir(fmt), lambda out: run(export_command(venv, hf_dir, fmt, out)))


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m kvserve.bench.openvino_export --model M [--format int4,int8]``: export ahead
    of a bench run (a first export takes minutes: longer, on a busy machine, than a peer's
    start-up is allowed)."""
    import argparse

    from kvserve.loader.resolve import resolve_model

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="what kvserve's --model takes")
    parser.add_argument("--format", default="int4", help=f"comma-separated: {', '.join(FORMATS)}")
    ns = parser.parse_args(argv)
    venv = OpenVinoVenv.default()
    if venv.missing():
        print(f"kvserve: {venv.missing()}", file=sys.stderr)
        return 1
    source = resolve_model(ns.model)
    if source.kind not in ("gguf", "hf_dir"):
        print(f"kvserve: OpenVINO needs a GGUF file or an HF directory, not a {source.kind} model", file=sys.stderr)
        return 1
    paths = ExportPaths(source.kind, str(source.path), default_cache_dir())
    for name in ns.format.split(","):
        print(ensure_exported(venv, paths, FORMATS[name.strip()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
