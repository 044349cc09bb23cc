"""Drives kvserve's LLMEngine over a workload, step by step, recording what the benchmark
reports: per-token timestamps, peak KV blocks, prefix-cache hits, preemptions and the
tokens actually computed (for FLOP accounting)."""
from __future__ import annotations

import time
from typing import Optional

from kvserve.tracing import label
from tqdm import tqdm

from kvserve.bench.decode_bytes import DecodeBytes, count_decode_bytes, mean_decode_context
from kvserve.bench.machine import ModelFlops
from kvserve.bench.timing import EngineRun, RequestTiming
from kvserve.bench.workloads import Workload, WorkloadSpec, build_workload
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


class KvserveDriver:
    name = "kvserve"

    def __init__(self, eargs: EngineArgs, engine: Optional[LLMEngine] = None) -> None:
        self.eargs = eargs
        self.engine = engine or LLMEngine(eargs)
        self.flops = ModelFlops.from_config(self.engine.model_config)
        # What a batch-1 greedy decode token reads (None where the weights live in worker
        # processes): a single-stream run's bytes per token against the read bandwidth.
        model = self.engine.model
        self.decode_bytes: Optional[DecodeBytes] = (
            None if model is None else count_decode_bytes(model, self.engine.kv_spec, greedy=True))

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def warmup(self) -> None:
        """A short run so first-call costs (allocations, kernel selection) stay out of the
        measurement."""
        spec = WorkloadSpec("warmup", "", num_requests=2, prompt_len=(16, 48), output_len=4,
                            seed=12345)
        self.run(build_workload(spec, self.vocab_size), progress=False)

    def run(self, workload: Workload, progress: bool = True, desc: str = "kvserve") -> EngineRun:
        """Submit the whole workload at once and step until it is done. Each run starts with
        an empty prefix cache: a repeat must not be served by the previous run's blocks."""
        eng = self.engine
        eng.kv_manager.reset_prefix_cache()
        kv, counters = eng.kv_manager, eng.counters
        queries0, hits0 = kv.prefix_cache_queries, kv.prefix_cache_hits
        preempt0 = eng.scheduler.num_preemptions
        prefill0, decode0 = counters.prefill_time_s, counters.decode_time_s
        generated0 = counters.generation_tokens

        spec0 = eng.spec_stats()
        started = time.perf_counter()
        timings: dict[str, RequestTiming] = {}
        order: list[str] = []
        pending: set[str] = set()
        queue = list(zip(workload.prompts, workload.output_lens))
        limit = workload.max_concurrency or len(queue)

        def submit() -> None:
            while queue and len(pending) < limit:
                prompt, n_out = queue.pop(0)
                rid = eng.add_request(None, prompt, greedy(n_out))
                # Timed from its own submission when the workload holds requests back.
                start = time.perf_counter() if workload.max_concurrency else started
                timings[rid] = RequestTiming(prompt_len=len(prompt), start=start)
                order.append(rid)
                pending.add(rid)

        submit()
        peak_blocks = kv.num_used_blocks
        computed_tokens = steps = 0
        bar = tqdm(total=workload.total_output_tokens, desc=desc, unit="tok", disable=not progress,
                   leave=False)
        while pending:
            steps_before = counters.steps
            with label("engine.step"):
                outputs = eng.step()
            now = time.perf_counter()
            peak_blocks = max(peak_blocks, kv.num_used_blocks)
            if counters.steps > steps_before:
                last = counters.step_history[-1]
                computed_tokens += last.num_prefill_tokens + last.num_decode_tokens
                steps += 1
            for out in outputs:
                timing = timings.get(out.request_id)
                if timing is None:
                    continue
                delta = out.outputs[0].delta_token_ids
                timing.add_tokens(delta, now)
                bar.update(len(delta))
                if out.finished:
                    pending.discard(out.request_id)
            if pending and not eng.has_unfinished_requests():
                raise RuntimeError(f"kvserve went idle with requests unfinished: {sorted(pending)}")
            submit()
        finished = time.perf_counter()
        bar.close()

        queries = kv.prefix_cache_queries - queries0
        sampled = counters.generation_tokens - generated0
        extra = {
            "ttft_measured_from": "submission",
            "peak_kv_blocks_used": peak_blocks,
            "kv_blocks_total": kv.num_blocks,
            "kv_block_size": kv.block_size,
            "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": (kv.prefix_cache_hits - hits0) / queries if queries else 0.0,
            "num_preemptions": eng.scheduler.num_preemptions - preempt0,
            "num_steps": steps,
            "prefill_step_time_s": counters.prefill_time_s - prefill0,
            "decode_step_time_s": counters.decode_time_s - decode0,
            "computed_tokens": computed_tokens,
            "sampled_tokens": sampled,
            "model_gflop": self.flops.flops(computed_tokens, sampled) / 1e9,
        }
        if self.decode_bytes is not None:
            extra["decode_bytes"] = self.decode_bytes.to_dict(
                mean_decode_context([len(p) for p in workload.prompts], workload.output_lens))
        if eng.speculator is not None:
            spec1 = eng.spec_stats()
            steps_, drafted, accepted = (spec1[k] - spec0[k] for k in
                                         ("spec_num_steps", "spec_draft_tokens", "spec_accepted_tokens"))
            extra.update(spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
                         spec_acceptance_rate=accepted / drafted if drafted else 0.0,
                         spec_mean_accepted_length=1 + accepted / steps_ if steps_ else 0.0)
        return EngineRun(self.name, [timings[r] for r in order], started, finished, extra)

    def close(self) -> None:
        self.engine = None
