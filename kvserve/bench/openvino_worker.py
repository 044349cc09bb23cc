"""The OpenVINO side of the OpenVINO GenAI peer. Runs as the OpenVINO venv's python
(``openvino_export.worker_command``), never in kvserve's: it imports nothing of kvserve, and
openvino_genai / transformers only inside the commands that need them.

    openvino_worker.py hf-dir --gguf FILE --out DIR
        the GGUF's weights, dequantized to fp32 by this venv's transformers, and its tokenizer,
        saved as an HF directory (what ``optimum-cli export openvino`` reads)
    openvino_worker.py serve --model DIR --threads N [--cache-gb G] [--max-num-batched-tokens T]
                             [--max-num-seqs S]
        an ``openvino_genai.ContinuousBatchingPipeline`` over DIR answering JSON lines on
        stdin: {"cmd": "warmup"}, {"cmd": "run", "prompts": [[ids]], "output_lens": [n],
        "max_concurrency": null | k}, {"cmd": "close"}; one JSON line back for each, and one
        when the pipeline is loaded, each {"ok": true, ...} or {"ok": false, "error": "..."}.

Replies go to the process's original stdout; fd 1 is pointed at stderr before OpenVINO
loads, so that anything its native code prints cannot corrupt them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO


# ------------------------------------------------------------------------------ hf-dir
def write_hf_dir(gguf_path: str, out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    # fp32: the file's blocks dequantized exactly; optimum then compresses from these values.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# ------------------------------------------------------------------------------- serve
@dataclass
class RequestTrace:
    """One request's token ids and the moments they were read (this process's clock)."""

    prompt_len: int
    submitted: float
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    def add(self, token_ids: list[int], now: float) -> None:
        self.token_ids.extend(int(t) for t in token_ids)
        self.token_times.extend([now] * len(token_ids))

    def to_dict(self) -> dict:
        return {"prompt_len": self.prompt_len, "submitted": self.submitted,
                "token_ids": self.token_ids, "token_times": self.token_times}


def greedy_config_fields(max_tokens: int) -> dict[str, Any]:
    """GenerationConfig fields of a benchmark request: greedy, exactly ``max_tokens`` new
    tokens whatever they are (EOS ignored, as every engine in the comparison does)."""
    return {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "ignore_eos": True,
            "do_sample": False, "num_return_sequences": 1}


def scheduler_fields(cache_gb: int, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, Any]:
    """SchedulerConfig fields: a KV cache of ``cache_gb`` (kvserve's default pool is 1 GiB),
    kvserve's token budget per step (OpenVINO's default is 256), prompts split and fused with
    decodes (OpenVINO's default), and no prefix caching: a repeat of a workload must not be
    served by the previous run's blocks, and OpenVINO offers no way to empty its prefix cache
    between runs."""
    return {"cache_size": cache_gb, "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": False, "dynamic_split_fuse": True, "max_num_seqs": max_num_seqs}


class Server:
    def __init__(self, model_dir: str, threads: int, cache_gb: int, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        scheduler = ov_genai.SchedulerConfig()
        fields = scheduler_fields(cache_gb, max_num_batched_tokens, max_num_seqs)
        for name, value in fields.items():
            setattr(scheduler, name, value)
        properties = {"INFERENCE_NUM_THREADS": threads}
        self.pipe = ov_genai.ContinuousBatchingPipeline(model_dir, scheduler, "CPU", properties)
        self.info = {"openvino_genai": ov_genai.__version__, "threads": threads, "cache_gb": cache_gb,
                     "scheduler": fields, **self._cpu_properties()}
        self._next_id = 0

    @staticmethod
    def _cpu_properties() -> dict:
        """The CPU plugin's defaults the pipeline runs with (KV cache and inference precision:
        none is overridden), for the record."""
        try:
            import openvino as ov

            core = ov.Core()
            values = {name: core.get_property("CPU", name)
                      for name in ("KV_CACHE_PRECISION", "INFERENCE_PRECISION_HINT", "FULL_DEVICE_NAME")}
            return {name.lower(): (value.get_type_name() if hasattr(value, "get_type_name") else str(value))
                    for name, value in values.items()}
        except Exception as exc:  # informational only
            return {"cpu_properties_error": repr(exc)}

    def _config(self, max_tokens: int):
        config = self.ov_genai.GenerationConfig()
        for name, value in greedy_config_fields(max_tokens).items():
            setattr(config, name, value)
        return config

    def _submit(self, prompt: list[int], n_out: int, submitted: float):
        import numpy as np
        import openvino as ov

        ids = ov.Tensor(np.asarray([prompt], dtype=np.int64))
        handle = self.pipe.add_request(self._next_id, ids, self._config(n_out))
        self._next_id += 1
        return handle, RequestTrace(len(prompt), submitted)

    def run(self, prompts: list[list[int]], output_lens: list[int],
            max_concurrency: Optional[int]) -> dict:
        """Every request submitted at once (or ``max_concurrency`` at a time, each timed from
        its own submission), then one pipeline step at a time, each request's new tokens
        stamped when the step that made them returns."""
        queue = list(zip(prompts, output_lens))
        limit = max_concurrency or len(queue)
        started = time.perf_counter()
        traces: list[RequestTrace] = []
        active: list[tuple[Any, RequestTrace, int]] = []
        steps = 0

        def submit() -> None:
            while queue and len(active) < limit:
                prompt, n_out = queue.pop(0)
                now = time.perf_counter() if max_concurrency else started
                handle, trace = self._submit(prompt, n_out, now)
                traces.append(trace)
                active.append((handle, trace, n_out))

        submit()
        while active:
            self.pipe.step()
            steps += 1
            now = time.perf_counter()
            for handle, trace, _ in active:
                while handle.can_read():
                    for output in handle.read().values():
                        trace.add(list(output.generated_ids), now)
            finished = [entry for entry in active if entry[1].token_ids and len(entry[1].token_ids) >= entry[2]]
            for entry in finished:
                active.remove(entry)
            if active and not self.pipe.has_non_finished_requests():
                raise RuntimeError("the pipeline went idle with requests unfinished")
            submit()
        return {"started": started, "finished": time.perf_counter(), "steps": steps,
                "requests": [t.to_dict() for t in traces]}


def _reply(out: TextIO, payload: dict) -> None:
    out.write(json.dumps(payload) + "\n")
    out.flush()


def serve(model_dir: str, threads: int, cache_gb: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # native prints land on stderr, never in the replies
    sys.stdout = sys.stderr
    try:
        server = Server(model_dir, threads, cache_gb, max_num_batched_tokens, max_num_seqs)
    except Exception as exc:
        _reply(replies, {"ok": False, "error": repr(exc)})
        return 1
    _reply(replies, {"ok": True, "info": server.info})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        command = request.get("cmd")
        try:
            if command == "close":
                _reply(replies, {"ok": True})
                return 0
            if command == "warmup":
                server.run([[1000 + i for i in range(16)]] * 2, [2, 2], None)
                _reply(replies, {"ok": True})
            elif command == "run":
                _reply(replies, {"ok": True, "run": server.run(request["prompts"], request["output_lens"],
                                                               request.get("max_concurrency"))})
            else:
                _reply(replies, {"ok": False, "error": f"unknown command {command!r}"})
        except Exception as exc:
            _reply(replies, {"ok": False, "error": repr(exc)})
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf-dir")
    p.add_argument("--gguf", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--cache-gb", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    ns = parser.parse_args(argv)
    if ns.command == "hf-dir":
        write_hf_dir(ns.gguf, ns.out)
        return 0
    return serve(ns.model, ns.threads, ns.cache_gb, ns.max_num_batched_tokens, ns.max_num_seqs)


if __name__ == "__main__":
    sys.exit(main())
