"""Peer: HF transformers ``generate`` on the same weights, one request at a time or in
static batches (left padding), greedy, EOS suppressed so every request makes its full
output length."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch
from tqdm import tqdm

from kvserve.bench.timing import EngineRun, RequestTiming
from kvserve.bench.workloads import Workload


class TimingStreamer:
    """A ``generate`` streamer that stamps each decoding step; the first ``put`` is the
    prompt, every later one is one new token per batch row."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.step_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf_model(path: str, kind: str, dtype: torch.dtype, device: str = "cpu"):
    """``kind`` is "gguf" (transformers dequantizes the file) or "hf_dir"."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    if kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) or ".",
                                                     gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


class HFPeer:
    """One loaded HF model; ``batch_size`` None runs sequentially, else static batches."""

    def __init__(self, model, dtype_name: str, batch_size: Optional[int]) -> None:
        self.model = model
        self.batch_size = batch_size
        mode = "seq" if batch_size is None else "batch"
        self.name = f"hf-{dtype_name}-{mode}"
        cfg = model.generation_config
        eos = cfg.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos or 0)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], max_new: int) -> tuple[torch.Tensor, list[float]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every row ends at the last column
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        streamer = TimingStreamer()
        dev = self.model.device
        out = self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new,
                                  min_new_tokens=max_new, do_sample=False, streamer=streamer,
                                  pad_token_id=self.pad_token_id)
        return out[:, width:].cpu(), streamer.step_times

    def warmup(self) -> None:
        self._generate([[1000 + i for i in range(16)]] * (1 if self.batch_size is None else 2), 2)

    def run(self, workload: Workload, progress: bool = True) -> EngineRun:
        n = workload.num_requests
        size = 1 if self.batch_size is None else (self.batch_size or n)
        started = time.perf_counter()
        timings: list[RequestTiming] = []
        bar = tqdm(total=n, desc=self.name, unit="req", disable=not progress, leave=False)
        for lo in range(0, n, size):
            prompts = workload.prompts[lo:lo + size]
            out_lens = workload.output_lens[lo:lo + size]
            # Sequential requests are timed from their own turn; a static batch's requests
            # all arrived at the start, like kvserve's offline requests.
            turn = time.perf_counter() if self.batch_size is None else started
            tokens, step_times = self._generate(prompts, max(out_lens))
            for row, (p, n_out) in enumerate(zip(prompts, out_lens)):
                t = RequestTiming(prompt_len=len(p), start=turn)
                t.output_token_ids = tokens[row, :n_out].tolist()
                t.token_times = step_times[:n_out]
                timings.append(t)
            bar.update(len(prompts))
        bar.close()
        extra = {"ttft_measured_from": "own turn" if self.batch_size is None else "submission",
                 "batch_size": size}
        return EngineRun(self.name, timings, started, time.perf_counter(), extra)

    def close(self) -> None:
        self.model = None
