"""Benchmark workloads: W1-W6 of DESIGN.md, or a JSONL file of prompts and lengths.

W1-W4 prompts are random token ids drawn from a fixed seed, so every engine sees identical
tokens and no tokenizer sits between the workload and the measurement. W6 is real text
(``texts/``: code to continue or edit, documents to summarise or rewrite), tokenized by the
model's own tokenizer: speculative decoding's drafts are never accepted on random ids.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from typing import Callable, Optional

from kvserve.config import ConfigError

# Draw ordinary tokens only: both real vocabularies keep their special and control tokens at
# the very start (and Gemma's image/unused tokens at the end).
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 30000


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    title: str  # what the workload stresses
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range; each request draws uniformly from it
    output_len: int
    shared_prefix_len: int = 0  # tokens common to every prompt, placed before prompt_len
    seed: int = 0
    # Text workloads: prompt files in kvserve/bench/texts/ (prompt_len is then ignored and
    # the request count cycles through them).
    texts: tuple[str, ...] = ()
    # At most this many requests in flight (None: all submitted at once); 1 = batch 1.
    max_concurrency: Optional[int] = None

    def with_overrides(self, **overrides) -> "WorkloadSpec":
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "prompt_len" in changes and isinstance(changes["prompt_len"], int):
            changes["prompt_len"] = (changes["prompt_len"], changes["prompt_len"])
        spec = dataclasses.replace(self, **changes)
        spec.validate()
        return spec

    def validate(self) -> None:
        lo, hi = self.prompt_len
        if self.num_requests < 1 or self.output_len < 1 or lo < 1 or hi < lo:
            raise ConfigError(f"workload {self.name}: need num_requests >= 1, output_len >= 1 "
                              f"and 1 <= min prompt len <= max prompt len (got {self})")
        if self.shared_prefix_len < 0:
            raise ConfigError(f"workload {self.name}: shared_prefix_len must be >= 0")

    @property
    def description(self) -> str:
        lo, hi = self.prompt_len
        prompt = f"{lo}" if lo == hi else f"{lo}-{hi}"
        if self.texts:
            prompt = "real-text (" + ", ".join(self.texts) + ")"
        if self.shared_prefix_len:
            prompt = f"{self.shared_prefix_len} shared + {prompt} distinct"
        noun = "request" if self.num_requests == 1 else "requests"
        batch = f", {self.max_concurrency} at a time" if self.max_concurrency else ""
        return (f"{self.title}: {self.num_requests} {noun}{batch}, {prompt} prompt tokens, "
                f"{self.output_len} output tokens")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["prompt_len"] = list(self.prompt_len)
        d["texts"] = list(self.texts)
        d["description"] = self.description
        return d


WORKLOADS: dict[str, WorkloadSpec] = {
    "W1": WorkloadSpec("W1", "mixed offline", num_requests=16, prompt_len=(32, 512), output_len=64),
    "W2": WorkloadSpec("W2", "decode-heavy", num_requests=32, prompt_len=(64, 64), output_len=256),
    "W3": WorkloadSpec("W3", "single stream", num_requests=1, prompt_len=(256, 256), output_len=256),
    "W4": WorkloadSpec("W4", "shared prefix", num_requests=32, prompt_len=(32, 32), output_len=32,
                       shared_prefix_len=1024),
    "W5": WorkloadSpec("W5", "long context", num_requests=8, prompt_len=(4096, 4096), output_len=256),
    "W6": WorkloadSpec("W6", "input-grounded", num_requests=4, prompt_len=(1, 1), output_len=128,
                       texts=("code_continue", "code_edit", "summarize", "readme_edit"),
                       max_concurrency=1),
}
TEXTS_DIR = os.path.join(os.path.dirname(__file__), "texts")


def load_text(name: str) -> str:
    path = os.path.join(TEXTS_DIR, name + ".txt")
    if not os.path.isfile(path):
        raise ConfigError(f"no workload text {name!r} (looked for {path})")
    with open(path, encoding="utf-8") as f:
        # No trailing newline: the model writes it, merged with the next line's indent as its
        # tokenizer would (a prompt ending in a bare newline is an unnatural tokenization).
        return f.read().rstrip()


@dataclass
class Workload:
    """Concrete requests: token ids and how many tokens to generate for each."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    description: str = ""
    spec: Optional[WorkloadSpec] = None
    max_concurrency: Optional[int] = None  # None: every request submitted at once

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens) or not self.prompts:
            raise ConfigError(f"workload {self.name}: needs one output length per prompt, "
                              f"and at least one prompt")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    def describe(self) -> dict:
        return {"name": self.name, "description": self.description,
                "num_requests": self.num_requests,
                "total_prompt_tokens": self.total_prompt_tokens,
                "total_output_tokens": self.total_output_tokens,
                "spec": self.spec.to_dict() if self.spec else None}


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    high = min(TOKEN_ID_HIGH, vocab_size)
    low = min(TOKEN_ID_LOW, high // 2)
    return [rng.randrange(low, high) for _ in range(n)]


def build_workload(spec: WorkloadSpec, vocab_size: int,
                   tokenize: Optional[Callable[[str], list[int]]] = None) -> Workload:
    spec.validate()
    if spec.texts:
        if tokenize is None:
            raise ConfigError(f"workload {spec.name} is real text: it needs the model's tokenizer")
        texts = [load_text(spec.texts[i % len(spec.texts)]) for i in range(spec.num_requests)]
        return Workload(spec.name, [tokenize(t) for t in texts], [spec.output_len] * spec.num_requests,
                        spec.description, spec, spec.max_concurrency)
    rng = random.Random(spec.seed)
    prefix = random_tokens(rng, spec.shared_prefix_len, vocab_size)
    lo, hi = spec.prompt_len
    prompts = [prefix + random_tokens(rng, rng.randint(lo, hi), vocab_size)
               for _ in range(spec.num_requests)]
    return Workload(spec.name, prompts, [spec.output_len] * spec.num_requests,
                    spec.description, spec, spec.max_concurrency)


def get_spec(name: str) -> WorkloadSpec:
    try:
        return WORKLOADS[name.upper()]
    except KeyError:
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None


def load_jsonl_workload(path: str, vocab_size: int, seed: int = 0,
                        tokenize: Optional[Callable[[str], list[int]]] = None,
                        default_output_len: int = 128) -> Workload:
    """Rows: ``{"prompt_len": L}`` (random tokens), ``{"prompt_token_ids": [...]}`` or
    ``{"prompt": "text"}``; each with an optional ``output_len`` (or ``max_tokens``)."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    output_lens: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object")
            if "prompt_token_ids" in row:
                ids = [int(t) for t in row["prompt_token_ids"]]
            elif "prompt_len" in row:
                ids = random_tokens(rng, int(row["prompt_len"]), vocab_size)
            elif "prompt" in row:
                if tokenize is None:
                    raise ConfigError(f"{path}:{lineno}: text prompts need the model's tokenizer")
                ids = tokenize(row["prompt"])
            else:
                raise ConfigError(f"{path}:{lineno}: give prompt_len, prompt_token_ids or prompt")
            n_out = int(row.get("output_len", row.get("max_tokens", default_output_len)))
            if not ids or n_out < 1:
                raise ConfigError(f"{path}:{lineno}: empty prompt or output_len < 1")
            prompts.append(ids)
            output_lens.append(n_out)
    if not prompts:
        raise ConfigError(f"{path}: no prompts")
    return Workload(path, prompts, output_lens, f"{len(prompts)} requests from {path}")


def workloads_json() -> str:
    """The workload table as JSON: ``python -m kvserve.bench.workloads > benchmarks/workloads.json``."""
    return json.dumps({name: spec.to_dict() for name, spec in WORKLOADS.items()}, indent=2) + "\n"


if __name__ == "__main__":
    print(workloads_json(), end="")
