"""Peer: llama.cpp through llama-cpp-python (an optional extra), on the same GGUF file.

On the shipped file and, as ``llamacpp-q4_0-*``, on the same weights requantized to Q4_0 by
llama.cpp's own quantizer (its fastest CPU format; cached beside the results). Two modes:
one request at a time through the high-level ``Llama.generate``, and llama.cpp's
own batching through the low-level API, every sequence in one ``llama_decode`` per step,
each with its own KV stream (``kv_unified = False``): with one unified buffer every decode
token would attend over all sequences' cells and llama.cpp would look slower than it is.
"""
from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvserve import environment
from kvserve.bench.timing import EngineRun, RequestTiming
from kvserve.bench.workloads import Workload


def import_llama_cpp():
    """The module, or None when the optional extra is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


class _QuietLogs:
    """llama.cpp logs every tensor it loads to stderr; route its log callback to nowhere."""

    def __init__(self, llama_cpp) -> None:
        # The ctypes callback must outlive every call into llama.cpp: keep it on the peer.
        self.callback = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))


# llama.cpp's fastest CPU format: its Q4_0 path is repacked and vectorised at load.
Q4_0_FTYPE = 2  # LLAMA_FTYPE_MOSTLY_Q4_0


def requantized_cache_dir() -> Path:
    """Where requantized GGUF files are kept between runs (``KVSERVE_CACHE_DIR`` or
    ``~/.cache/kvserve``), under ``llamacpp/``."""
    root = str(environment.cache_dir())
    return Path(root) / "llamacpp"


def requantize_q4_0(gguf_path: str, cache_dir: Path | None = None) -> str:
    """The same weights requantized to Q4_0 by llama.cpp's own ``llama_model_quantize``
    (tensors in other formats are dequantized first), written once and reused: keyed by the
    source's name, size and modification time."""
    llama_cpp = import_llama_cpp()
    src = Path(gguf_path)
    stat = src.stat()
    out_dir = cache_dir or requantized_cache_dir()
    out = out_dir / f"{src.stem}.{stat.st_size}-{int(stat.st_mtime)}.Q4_0.gguf"
    if out.exists():
        return str(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    quiet = _QuietLogs(llama_cpp)  # noqa: F841 (kept alive for the call)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_0_FTYPE
    params.allow_requantize = True  # the source's tensors are already quantized
    params.nthread = os.cpu_count() or 1
    partial = out.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(partial).encode(), ctypes.byref(params))
    if rc != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed on {src} (code {rc})")
    partial.rename(out)  # only a complete file is ever found in the cache
    return str(out)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class LlamaCppSequential:
    name = "llamacpp-seq"

    def __init__(self, gguf_path: str, n_threads: int) -> None:
        self.llama_cpp = import_llama_cpp()
        self._quiet = _QuietLogs(self.llama_cpp)
        self.gguf_path = gguf_path
        self.n_threads = n_threads
        self._llm = None
        self._n_ctx = 0

    def _model(self, n_ctx: int):
        if self._llm is None or self._n_ctx < n_ctx:
            self._llm = None
            self._n_ctx = _round_up(n_ctx, 256)
            self._llm = self.llama_cpp.Llama(
                model_path=self.gguf_path, n_ctx=self._n_ctx, n_batch=512, n_ubatch=512,
                n_threads=self.n_threads, n_threads_batch=self.n_threads, verbose=False)
        return self._llm

    def _one(self, prompt: list[int], n_out: int, timing: RequestTiming) -> None:
        llm = self._model(len(prompt) + n_out)
        llm.reset()  # no reuse of the previous request's KV: each request pays its own prefill
        gen = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        for token in gen:
            timing.add_tokens([token], time.perf_counter())
            if timing.num_output_tokens >= n_out:
                break
        gen.close()

    def warmup(self) -> None:
        self._one([1000 + i for i in range(16)], 2, RequestTiming(16, time.perf_counter()))

    def run(self, workload: Workload, progress: bool = True) -> EngineRun:
        self._model(workload.max_seq_len)
        started = time.perf_counter()
        timings = []
        for prompt, n_out in tqdm(list(zip(workload.prompts, workload.output_lens)),
                                  desc=self.name, unit="req", disable=not progress, leave=False):
            t = RequestTiming(prompt_len=len(prompt), start=time.perf_counter())
            self._one(prompt, n_out, t)
            timings.append(t)
        return EngineRun(self.name, timings, started, time.perf_counter(),
                         {"ttft_measured_from": "own turn", "n_threads": self.n_threads})

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
        self._llm = None


class LlamaCppBatched:
    """All prompts prefilled together (in ``n_batch``-token decode calls), then one
    ``llama_decode`` per step carrying the next token of every unfinished sequence."""

    name = "llamacpp-batch"

    def __init__(self, gguf_path: str, n_threads: int, n_batch: int = 2048) -> None:
        lc = self.llama_cpp = import_llama_cpp()
        self._quiet = _QuietLogs(lc)
        self.n_threads = n_threads
        self.n_batch = n_batch
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def _context(self, n_seqs: int, max_seq_len: int):
        lc = self.llama_cpp
        params = lc.llama_context_default_params()
        params.n_seq_max = n_seqs
        params.kv_unified = False  # each sequence its own KV stream of n_ctx / n_seq_max cells
        params.n_ctx = n_seqs * _round_up(max_seq_len, 256)
        params.n_batch = self.n_batch
        params.n_ubatch = min(512, self.n_batch)
        params.n_threads = params.n_threads_batch = self.n_threads
        ctx = lc.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def _decode(self, ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence id, wants logits)."""
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if logits else 0
        batch.n_tokens = len(entries)
        rc = self.llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def _argmax(self, ctx, batch_index: int) -> int:
        ptr = self.llama_cpp.llama_get_logits_ith(ctx, batch_index)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate(self, workload: Workload, progress: bool = False
                 ) -> tuple[float, list[RequestTiming]]:
        """(start time, per-request timings); creating the context (allocating its KV
        cache) is set-up, like loading kvserve's engine, and stays out of the timing."""
        lc = self.llama_cpp
        n = workload.num_requests
        ctx = self._context(n, workload.max_seq_len)
        batch = lc.llama_batch_init(max(self.n_batch, n), 0, 1)
        started = time.perf_counter()
        timings = [RequestTiming(prompt_len=len(p), start=started) for p in workload.prompts]
        bar = tqdm(total=workload.total_output_tokens, desc=self.name, unit="tok",
                   disable=not progress, leave=False)
        try:
            # Prefill: all prompts, flattened, in n_batch-sized decode calls; a sequence's
            # logits are read from the call that holds its last prompt token.
            flat = [(tok, pos, seq, pos == len(p) - 1)
                    for seq, p in enumerate(workload.prompts) for pos, tok in enumerate(p)]
            for lo in range(0, len(flat), self.n_batch):
                chunk = flat[lo:lo + self.n_batch]
                self._decode(ctx, batch, chunk)
                now = time.perf_counter()
                for i, (_, _, seq, wants) in enumerate(chunk):
                    if wants:
                        timings[seq].add_tokens([self._argmax(ctx, i)], now)
                        bar.update(1)
            # Decode: one token for every unfinished sequence per call.
            while True:
                active = [s for s in range(n) if timings[s].num_output_tokens < workload.output_lens[s]]
                if not active:
                    break
                entries = [(timings[s].output_token_ids[-1],
                            len(workload.prompts[s]) + timings[s].num_output_tokens - 1, s, True)
                           for s in active]
                self._decode(ctx, batch, entries)
                now = time.perf_counter()
                for i, s in enumerate(active):
                    timings[s].add_tokens([self._argmax(ctx, i)], now)
                bar.update(len(active))
        finally:
            bar.close()
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return started, timings

    def warmup(self) -> None:
        self.generate(Workload("warmup", [[1000 + i for i in range(16)]] * 2, [2, 2]))

    def run(self, workload: Workload, progress: bool = True) -> EngineRun:
        started, timings = self.generate(workload, progress)
        return EngineRun(self.name, timings, started, time.perf_counter(),
                         {"ttft_measured_from": "submission", "n_threads": self.n_threads,
                          "n_batch": self.n_batch, "kv_unified": False})

    def close(self) -> None:
        if self.model:
            self.llama_cpp.llama_model_free(self.model)
        self.model = None
