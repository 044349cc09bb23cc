"""LLMEngine: add_request / step / abort. One step = schedule -> build batch -> forward ->
sample -> update. The scheduler -> runner contract is the explicit ``SchedulerOutput``."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import itertools
import logging
import os
import secrets
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from kvserve import ops
from kvserve.ops import apply_kernel_config
from kvserve.config import ConfigError, EngineArgs, ModelConfig
from kvserve.kv_budget import AUTO, KVBudget, auto_kv_cache_memory, default_kv_cache_memory, step_workspace_bytes
from kvserve.kv_cache import KVCacheSpec, kv_cache_groups
from kvserve.kv_manager import KVCacheManager, max_blocks_per_request
from kvserve.async_step import AsyncStepLoop
from kvserve.executor.base import Executor
from kvserve.batch import SchedulerOutput
from kvserve.executor.builder import StepBuilder
from kvserve.executor.launch import under_torchrun
from kvserve.executor.step import StepInput, StepOutput
from kvserve.executor.multiproc import MultiprocExecutor
from kvserve.executor.uniproc import UniProcExecutor
from kvserve.executor.worker import WorkerSpec
from kvserve.loader import load_config, load_model, return_freed_heap, source_has_blocks
from kvserve.loader.resolve import resolve_model
from kvserve.loader.safetensors import safetensors_files
from kvserve.models.tensor_parallel import check_tp_shape, rank_kv_spec
from kvserve.output_processor import OutputProcessor
from kvserve.pooling import EmbeddingOutput, mean_pool
from kvserve.quant import has_prefill_copies, int8_prompt_layers, prefill_copy_bytes, prefill_copy_format
from kvserve.request import (EngineBusy, Logprob, Request, RequestOutput, RequestRejected, RequestStatus,
                             SamplingParams)
from kvserve.sampler import needs_no_step_state
from kvserve.scheduler import Scheduler
from kvserve.structured.grammar import GrammarCompiler
from kvserve.speculative import Speculator, build_speculator, parse_speculative_config
from kvserve.executor.draft_model import DraftModel, DraftModelDrafter, load_draft_model
from kvserve.tokenizer import load_tokenizer
from kvserve.tracing import label
from kvserve.disagg.block_io import gather_blocks, layout_id, scatter_blocks
from kvserve.config.disagg import DisaggConfig
from kvserve.disagg.consumer import KVConsumer
from kvserve.disagg.factory import make_connector
from kvserve.disagg.params import (FirstTokenLogprob, KVTransferParams, RemoteDecodeRequest,
                                   parse_kv_transfer_params, prompt_digest)
from kvserve.disagg.producer import KVProducer
from kvserve.disagg.stats import TransferStats
from kvserve.stopping import check_token_stop

logger = logging.getLogger("kvserve")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """Whether bf16 weights beat fp32 ones here: AVX512-BF16 or AMX (bf16 matmuls at about
    twice the fp32 rate), or AVX2 with FMA where kvserve's kernels are built (they widen the
    bf16 weights in registers: half the bytes of fp32 per decode step, and on a 2-core Zen 3
    a 256-row prefill GEMM 1.26x faster than kvserve's fp32 kernel, at MKL's speed)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return True
    return {"avx2", "fma", "f16c"} <= flags and ops.load_extension() is not None


def resolve_precision(dtype: str, quantization: Optional[str],
                      device: torch.device, stored_blocks: bool = False) -> tuple[torch.dtype, Optional[str]]:
    """(activation dtype, linear weight format). ``auto`` on a CPU keeps fp32 activations and
    reads a quantized GGUF's own blocks (``stored_blocks``: the file has some), "gguf"; other
    models' linear weights go to bf16 where the CPU has fast bf16: bf16 speed, near-fp32 accuracy."""
    explicit_none = quantization == "none"
    quantization = None if quantization in (None, "none") else quantization
    if dtype != "auto":
        return _DTYPES[dtype], quantization
    if device.type == "cuda":
        return (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16), quantization
    if quantization is None and stored_blocks and not explicit_none:
        return torch.float32, "gguf"
    if quantization is None and cpu_has_fast_bf16():
        quantization = "bf16"
    return torch.float32, quantization


def _checkpoint_files(path: str) -> list[Path]:
    """The files holding a model's weights: a GGUF, or a directory's safetensors."""
    p = Path(path)
    return [p] if p.is_file() else safetensors_files(p)


@dataclass
class StepStats:
    """What one engine step did; the profiler and metrics read these."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    duration_s: float = 0.0


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    rejected_requests: int = 0
    steps: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    step_history: list[StepStats] = field(default_factory=list)


@contextmanager
def _cyclic_gc_paused():
    """Loading makes a few hundred thousand container objects (Gemma 3's tokenizer most of
    them), and each automatic full collection on the way walks all of them again: six of them,
    0.1-0.25 s each, were ~2.7 s of Gemma 3's 9 s engine start. The cyclic collector waits until
    the load is done, then makes one pass (so that the first requests do not pay for walking
    the new objects instead).

    The process's first engine start makes it a full collection, as CPython would have made
    anyway soon after (a pass over the generations below would leave the load's objects counted
    as pending, and the full collection that they trigger would fall in the first requests). A
    later start collects generations 0 and 1 only: while the collector was paused, everything
    the load made stayed in generation 0 (CPython 3.11-3.13), and a full collection also walks
    all that the process held before, in a process that has built many engines (the test
    suite's) 0.3-1 s a start, most of a tiny model's."""
    global _started_before
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
            gc.collect(1 if _started_before else 2)
        return_freed_heap()  # what the tokenizer's load and the collection freed (50-80 MiB)
        _started_before = True


_started_before = False  # whether an engine of this process has loaded (see _cyclic_gc_paused)


class LLMEngine:
    def __init__(self, args: Optional[EngineArgs] = None, **kwargs) -> None:
        args = args or EngineArgs(**kwargs)
        args.validate()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        # Resolved here (auto routes named), before any weight is packed for a route.
        self.kernel_config = apply_kernel_config(args.kernel_config)
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for but torch sees no CUDA device")
        self.source = resolve_model(args.model)
        self.dtype, self.weight_format = resolve_precision(args.dtype, args.quantization, self.device,
                                                           stored_blocks=source_has_blocks(self.source))
        if args.kv_cache_dtype != "auto":
            kv_dtype: Union[str, torch.dtype] = args.kv_cache_dtype
        else:
            kv_dtype = torch.bfloat16 if self.weight_format else self.dtype

        t0 = time.perf_counter()
        # The tokenizer loads beside the weights: its ~2 s (importing transformers, parsing a
        # vocabulary) is Python, the weights' repacking native code that releases the GIL.
        tokenizer_loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
        tokenizer_future = tokenizer_loader.submit(load_tokenizer, self.source)
        tokenizer_loader.shutdown(wait=False)
        with _cyclic_gc_paused():
            # The model runs in worker processes: with parallelism, or asked for (async
            # scheduling overlaps the engine's work with a worker's steps).
            self.parallel = (args.tensor_parallel_size * args.pipeline_parallel_size > 1
                             or args.worker_process or args.async_scheduling)
            if self.parallel:
                # The weights live in the worker processes; the engine needs only the shape.
                self.model = None
                self.model_config = load_config(self.source)
                check_tp_shape(self.model_config, args.tensor_parallel_size)
                if args.pipeline_parallel_size > self.model_config.num_hidden_layers:
                    raise ConfigError(f"pipeline_parallel_size {args.pipeline_parallel_size} exceeds the "
                                      f"{self.model_config.num_hidden_layers} layers")
            else:
                self.model, self.model_config = load_model(self.source, dtype=self.dtype, device=self.device,
                                                           quantization=self.weight_format,
                                                           int4_prefill=args.int4_prefill)
            # int4 layers with prefill copies compute prompt and generated tokens in different
            # formats. The workers of a parallel engine hold the layers: assume so for int4 unless
            # told "blocks" (the prefix cache then only shares fewer blocks, never wrong ones).
            if self.model is None:
                self.prefill_copies = ((self.weight_format == "int4" and args.int4_prefill != "blocks")
                                       or (self.weight_format == "gguf" and args.int4_prefill == "int8"
                                           and ops.int8_prompt_kernels()))
            else:
                self.prefill_copies = has_prefill_copies(self.model)
            self.prefill_copy_bytes = 0 if self.model is None else prefill_copy_bytes(self.model)
            self.prefill_copy_format = None if self.model is None else prefill_copy_format(self.model)
            self.int8_prompt_layers = 0 if self.model is None else int8_prompt_layers(self.model)
            self.tokenizer = tokenizer_future.result()
        self.load_time_s = time.perf_counter() - t0
        cfg: ModelConfig = self.model_config
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids))

        cache = args.cache_config()
        self.spec_config = parse_speculative_config(args.speculative_config)
        # The KV manager's groups are the model's, however many processes hold the layers.
        self.kv_groups = kv_cache_groups(cfg, reclaim_sliding_window=not args.disable_sliding_window_reclaim)
        if (self.spec_config is not None and self.spec_config.method == "draft_model"
                and self.kv_groups[0].is_sliding):
            # The draft model keeps every position's KV in group 0's blocks; with no full group
            # (every layer sliding) group 0 gives those back: keep the whole context.
            logger.warning("sliding-window reclaim is off: a draft model needs a full-attention KV group")
            self.kv_groups = kv_cache_groups(cfg, reclaim_sliding_window=False)
        if self.parallel:
            # One rank's share: the budget is per rank. The largest rank's KV per block (its
            # heads; its stage's layers of each group).
            self.kv_spec = rank_kv_spec(cfg, args.tensor_parallel_size, args.pipeline_parallel_size,
                                        cache.block_size, kv_dtype, self.kv_groups)
        else:
            self.kv_spec = KVCacheSpec.for_model(cfg, cache.block_size, kv_dtype, groups=self.kv_groups)
        # A draft model keeps its KV in the same blocks (a second cache, same block ids: the
        # full-attention group's table). It runs in this process (it proposes before the step
        # is built), also when the target runs on worker processes.
        self.draft_model: Optional[DraftModel] = None
        if self.spec_config is not None and self.spec_config.method == "draft_model":
            self.draft_model = load_draft_model(self.spec_config, cfg, self.tokenizer, self.dtype,
                                                self.weight_format, kv_dtype, cache.block_size, self.device,
                                                self.max_model_len)
        draft_bytes_per_block = self.draft_model.kv_spec.bytes_per_block if self.draft_model else 0
        # The budget bounds each process's KV: one process holds the target's and the draft's;
        # with workers, each rank holds its share of the target's and this process the draft's.
        if self.parallel:
            bytes_per_block = max(self.kv_spec.bytes_per_block, draft_bytes_per_block)
        else:
            bytes_per_block = self.kv_spec.bytes_per_block + draft_bytes_per_block
        # A sliding-window group's released entries point at a reserved, always-zero block.
        num_reserved = 1 if self.kv_spec.has_sliding_groups else 0
        # Blocks a request of the maximum length holds at its peak, over all groups.
        self.max_request_blocks = max_blocks_per_request(self.max_model_len, cache.block_size,
                                                         self.kv_spec.group_windows, args.max_num_batched_tokens)
        self.workspace_bytes = self._step_workspace_bytes(args)
        if cache.num_gpu_blocks is not None:
            num_blocks = cache.num_gpu_blocks
            self.kv_budget = KVBudget(num_blocks * bytes_per_block, "explicit block count")
            self.budget_blocks = num_blocks
        else:
            self.kv_budget = self._kv_budget(cache.kv_cache_memory)
            num_blocks = self.kv_budget.bytes // bytes_per_block
            self.budget_blocks = num_blocks
            # No point holding more than max_num_seqs full contexts.
            max_useful = args.max_num_seqs * self.max_request_blocks + 1 + num_reserved
            num_blocks = min(num_blocks, max_useful)
        if num_blocks < 1 + num_reserved:
            raise ConfigError(f"kv_cache_memory is too small for {1 + num_reserved} blocks "
                              f"({bytes_per_block} bytes each)"
                              + (f"; {self.kv_budget.describe()}" if self.kv_budget.rule == AUTO else ""))
        self.num_blocks = num_blocks
        # This process's KV (a rank's, with workers; the draft's is described apart then).
        self.kv_cache_bytes = num_blocks * (self.kv_spec.bytes_per_block if self.parallel else bytes_per_block)

        self.kv_manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                         self.kv_spec.group_windows,
                                         hash_prompt_boundary=self.prefill_copies)
        # Pipeline stages work on different micro-batches at once: one step in flight per stage.
        self.num_micro_batches = args.pipeline_parallel_size
        # Multi-step rounds run in this process's runner, for decodes whose sampling needs
        # nothing from the step before (the runner's later steps feed sampled tokens back).
        multi_step = args.num_scheduler_steps > 1 and not self.parallel and not self.spec_config
        if args.num_scheduler_steps > 1 and not multi_step:
            logger.warning("num_scheduler_steps %d ignored: multi-step decoding runs in a single process "
                           "without speculative decoding", args.num_scheduler_steps)
        self.scheduler = Scheduler(self.kv_manager, args.max_num_batched_tokens, args.max_num_seqs,
                                   self.max_model_len, args.enable_chunked_prefill,
                                   num_micro_batches=self.num_micro_batches,
                                   num_scheduler_steps=args.num_scheduler_steps if multi_step else 1,
                                   multi_step_eligible=needs_no_step_state if multi_step else None,
                                   before_free=self._publish_kv if args.kv_transfer is not None else None)
        self._in_flight: deque[tuple[int, SchedulerOutput]] = deque()
        async_scheduling = args.async_scheduling and self._async_scheduling_applies(args)
        self.executor: Executor
        if self.parallel:
            spec = WorkerSpec(model=args.model, dtype=self.dtype, weight_format=self.weight_format,
                              int4_prefill=args.int4_prefill,
                              kv_dtype=kv_dtype, block_size=cache.block_size, num_blocks=num_blocks,
                              device=args.device, num_threads=args.num_threads or 1,
                              timeout_s=args.distributed_timeout_s,
                              tensor_parallel_size=args.tensor_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size,
                              kv_groups=self.kv_groups,
                              kernel_config=args.kernel_config,
                              async_scheduling=async_scheduling,
                              shm_path=None if under_torchrun() else
                              f"/dev/shm/kvserve-{os.getpid()}-{secrets.token_hex(4)}")
            self.executor = MultiprocExecutor(spec, args.tensor_parallel_size * args.pipeline_parallel_size)
        else:
            self.executor = UniProcExecutor(self.model, cfg, self.kv_spec, num_blocks, self.device)
        self.step_builder = StepBuilder(cfg.vocab_size)
        self.async_loop: Optional[AsyncStepLoop] = (
            AsyncStepLoop(self.scheduler, self.executor, self.step_builder, functools.partial(self._schedule, 0))
            if async_scheduling else None)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Structured outputs; llguidance's view of the vocabulary is built on first use.
        self.grammar_compiler = GrammarCompiler(self.tokenizer.hf, cfg.vocab_size, self.eos_token_ids)
        drafter = (DraftModelDrafter(self.draft_model, num_blocks, self.device,
                                     self.spec_config.num_speculative_tokens)
                   if self.draft_model is not None else None)
        self.speculator: Optional[Speculator] = (build_speculator(self.spec_config, drafter)
                                                 if self.spec_config else None)
        self.counters = EngineCounters()
        self._request_counter = itertools.count()
        self._pending_finished: set[str] = set()
        # Disaggregation: a prefill instance publishes its requests' KV, a decode instance
        # receives it (kvserve/disagg); neither on an ordinary engine.
        self.transfer_stats = TransferStats()
        self.kv_producer: Optional[KVProducer] = None
        self.kv_consumer: Optional[KVConsumer] = None
        self.kv_layout = layout_id(self.kv_spec)
        if args.kv_transfer is not None:
            self._start_kv_transfer(args.kv_transfer)

    @staticmethod
    def _async_scheduling_applies(args: EngineArgs) -> bool:
        """Whether async scheduling can run with these settings; says why not in a log line."""
        if args.speculative_config is not None:
            # Drafts are proposed from the tokens before them and verified runs roll back: not
            # built on placeholders yet.
            logger.warning("async scheduling: speculative decoding keeps the synchronous step")
            return False
        if args.tensor_parallel_size > 1:
            # A decode's input is the token the step before sampled, and only the sampling rank
            # has it: the other ranks would need it sent (not built yet).
            logger.warning("async scheduling: tensor-parallel ranks other than the sampling one do not see "
                           "the sampled tokens; keeping the synchronous step")
            return False
        if args.pipeline_parallel_size > 1:
            logger.warning("async scheduling: pipeline stages keep their own overlap of micro-batches "
                           "(the synchronous step)")
            return False
        logger.info("async scheduling: the engine schedules step N+1 while the worker computes step N")
        return True

    # ------------------------------------------------------------------ requests
    @property
    def kv_cache_tokens(self) -> int:
        """How many tokens the KV pool holds."""
        return self.num_blocks * self.kv_spec.block_size

    def describe_kernels(self) -> str:
        """The start-up line's kernel configuration, as resolved on this machine."""
        return self.kernel_config.describe()

    def _mapped_weight_bytes(self) -> int:
        """Weight bytes read in place from the model file (GGUF blocks the layers map)."""
        from kvserve.row_table import GGUFRows

        if self.model is None:
            return 0
        return sum({m.raw.data_ptr(): m.raw.numel() for m in self.model.modules() if isinstance(m, GGUFRows)}.values())

    def _step_workspace_bytes(self, args: EngineArgs) -> int:
        cfg = self.model_config
        q_width = cfg.num_attention_heads * cfg.head_dim
        kv_width = 2 * cfg.num_key_value_heads * cfg.head_dim
        intermediate = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(1, cfg.num_experts_per_tok))
        return step_workspace_bytes(cfg.hidden_size, intermediate, q_width, kv_width, cfg.vocab_size,
                                    args.max_num_batched_tokens, args.max_num_seqs)

    def _kv_budget(self, requested: object) -> KVBudget:
        """The pool's bytes: explicit, ``auto`` (kvserve.kv_budget) or the small default."""
        device_free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        if requested is None:
            return KVBudget(default_kv_cache_memory(device_free), "default")
        if requested != AUTO:
            return KVBudget(int(requested), "explicit")
        if device_free is not None:
            return auto_kv_cache_memory(0, self.workspace_bytes, available=device_free)
        mapped, num_pools = self._mapped_weight_bytes(), 1
        if self.model is None:
            # Worker ranks on this host each allocate a pool, and load after it is sized: the
            # checkpoint counts as their weights (a lower bound where they hold more than it).
            num_pools = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if under_torchrun() else 0
            num_pools = num_pools or self.args.tensor_parallel_size * self.args.pipeline_parallel_size
            if self.source.path:
                mapped = sum(f.stat().st_size for f in _checkpoint_files(self.source.path))
        return auto_kv_cache_memory(mapped, self.workspace_bytes, num_pools=num_pools)

    def describe_memory(self) -> str:
        """The start-up line's memory: the weights this process holds, those it reads in place
        from the model file (mapped: resident only as far as read), the KV pool, and the linear
        layers' formats."""
        if self.model is None:
            return f"memory: weights in the worker processes; KV pool {self.kv_cache_bytes / 2**20:.0f} MiB per rank"
        seen, held = set(), 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.device.type != "meta" and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                held += t.untyped_storage().nbytes()
        mapped = self._mapped_weight_bytes()
        formats = getattr(self.model, "weight_format_counts", None)
        return (f"memory: weights {held / 2**20:.0f} MiB held"
                + (f" + {mapped / 2**20:.0f} MiB read in place from the file" if mapped else "")
                + f", KV pool {self.kv_cache_bytes / 2**20:.0f} MiB ({self.kv_budget.describe()}"
                + (f"; {self.kv_budget.bytes / 2**20:.0f} MiB capped at max_num_seqs full contexts"
                   if self.num_blocks < self.budget_blocks else "") + ")"
                + f", step workspace ~{self.workspace_bytes / 2**20:.0f} MiB (estimated)"
                + (f"; layers: {', '.join(f'{n} x {k}' for k, n in formats.items())}" if formats else ""))

    def describe_kv_cache(self) -> str:
        spec = self.kv_spec
        per_group = f" of a group of {spec.slots_per_group} layers" if spec.num_groups > 1 else ""
        text = (f"KV cache: {self.num_blocks} blocks x {spec.block_size} tokens = "
                f"{self.kv_cache_tokens} tokens{per_group}, {self.kv_cache_bytes / 2**20:.1f} MiB "
                f"({spec.describe_token()}); ")
        if spec.has_sliding_groups:
            # What a token costs in each group, and what the longest request really holds: its
            # full groups' whole context, its sliding groups' window plus one prefill chunk.
            windows = spec.group_windows
            groups = ", ".join(
                f"{windows.count(w)} x {'full' if w is None else f'window {w}'} at {spec.bytes_per_group_token} "
                f"bytes per token each" for w in dict.fromkeys(windows))
            blocks = self.max_request_blocks
            text += (f"groups: {groups}; a {self.max_model_len}-token request holds at most {blocks} blocks "
                     f"= {blocks * spec.bytes_per_block / 2**20:.1f} MiB, the cost of "
                     f"{blocks * spec.bytes_per_block // spec.bytes_per_token} tokens in every layer "
                     f"({self.max_model_len * spec.bytes_per_token / 2**20:.1f} MiB without reclaim); ")
        return (text + f"activations {str(self.dtype).removeprefix('torch.')}, linear weights "
                f"{self.weight_format or str(self.dtype).removeprefix('torch.')}"
                + (f" (Q4_1 for generated tokens, {self.prefill_copy_format} copies for prompt tokens: "
                   f"+{self.prefill_copy_bytes / 2**20:.1f} MiB)" if self.prefill_copy_bytes else "")
                + (f" (prompt tokens under int8 activations in {self.int8_prompt_layers} layers)"
                   if self.int8_prompt_layers else "")
                + (f"; with the draft model's KV ({self.draft_model.kv_spec.describe_token()}"
                   + (f", {self.num_blocks * self.draft_model.kv_spec.bytes_per_block / 2**20:.1f} MiB in the "
                      "engine's process" if self.parallel else "")
                   + ") in the full-attention group's blocks" if self.draft_model else "")
                + (f"; per rank of {self.args.tensor_parallel_size} (TP) x "
                   f"{self.args.pipeline_parallel_size} (PP) worker processes" if self.parallel else ""))

    def new_request_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def tokenize_prompt(self, prompt: Union[str, list[int]]) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestRejected("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise RequestRejected("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab})")
        return None, token_ids

    def add_request(self, request_id: Optional[str], prompt: Union[str, list[int]],
                    params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> str:
        """Queue a request; raises RequestRejected (with the reason) if it can never be served."""
        params = params or SamplingParams()
        request_id = request_id or self.new_request_id()
        try:
            params.validate(self.model_config.vocab_size)
            if request_id in self.output_processor:
                raise RequestRejected(f"request id {request_id!r} is already in use")
            if (self.args.max_waiting_requests is not None
                    and self.scheduler.num_waiting >= self.args.max_waiting_requests):
                raise EngineBusy(f"too many waiting requests "
                                 f"(max_waiting_requests={self.args.max_waiting_requests})")
            prompt_text, prompt_ids = self.tokenize_prompt(prompt)
            transfer = self._check_kv_transfer(params, prompt_ids)
            if isinstance(transfer, RemoteDecodeRequest):
                # The prefill instance's share: the prompt and its first token, no more.
                transfer = dataclasses.replace(transfer, max_tokens=params.max_tokens)
                params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
            grammar = (self.grammar_compiler.compile(params.structured_outputs)
                       if params.structured_outputs is not None else None)
            arrival = arrival_time if arrival_time is not None else time.monotonic()
            children = []
            for i in range(params.n):
                child_id = request_id if params.n == 1 else f"{request_id}#{i}"
                child = Request(request_id=child_id, prompt_token_ids=prompt_ids,
                                sampling_params=params, eos_token_ids=self.eos_token_ids,
                                arrival_time=arrival,
                                prefix_leader=children[0] if children else None)
                # A seeded request's RNG lives with the model runner; siblings get distinct
                # streams derived from the one seed (seed + i, see executor.builder).
                if grammar is not None:
                    child.grammar = grammar.new_state()
                if params.prompt_logprobs is not None and i == 0:
                    child.prompt_logprobs = []  # siblings share the prompt: one computes them
                child.kv_transfer = transfer
                children.append(child)
            self.scheduler.check_fits(children[0])
        except RequestRejected:
            self.counters.rejected_requests += 1
            raise
        self.output_processor.add_group(request_id, prompt_text, prompt_ids, children)
        for child in children:
            if isinstance(transfer, KVTransferParams):
                self._add_received(child, transfer)
            else:
                self.scheduler.add_request(child)
        self.counters.prompt_tokens += len(prompt_ids)
        return request_id

    def embed(self, prompt: Union[str, list[int]], normalize: bool = True) -> EmbeddingOutput:
        """The prompt's embedding: its final-norm hidden states mean-pooled over its positions
        and, with ``normalize``, L2-normalised (kvserve/pooling.py). Runs the model's forward
        over the prompt now, outside any step (call it between steps, from the thread that
        steps), in a KV cache of its own (executor/hidden_states.py): the scheduler, the pool
        and the prefix cache see nothing of it. Raises RequestRejected for a prompt the model
        cannot take (empty, too long, a token id outside the vocabulary) or a parallel engine."""
        _, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:  # a tokenizer without byte fallback can drop every character
            raise RequestRejected("the input has no tokens: the tokenizer keeps nothing of its text")
        if len(token_ids) > self.max_model_len:
            raise RequestRejected(f"the input has {len(token_ids)} tokens, more than this model's "
                                  f"context of {self.max_model_len} tokens")
        if self.parallel:
            raise RequestRejected("embeddings are not served with tensor or pipeline parallelism "
                                  "(the model's hidden states are split over its worker processes)")
        apply_kernel_config(self.kernel_config)  # (another engine in this process may differ)
        with label("embed"):
            hidden = self.executor.prompt_hidden_states(token_ids, self.args.max_num_batched_tokens)
        return EmbeddingOutput(token_ids, mean_pool(hidden, normalize).tolist())

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        """Abort now: blocks of every child are freed before this returns."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            child_ids = self.output_processor.child_ids(rid)
            if not child_ids:
                continue
            # Counted first: a metrics scrape from another thread must not see the request gone
            # from the running set but not yet counted as aborted.
            self.counters.aborted_requests += 1
            if self.kv_consumer is not None:
                for cid in child_ids:
                    if self.kv_consumer.abort(cid):  # its KV was on its way: blocks freed once it lands
                        self.output_processor.seq_by_request_id[cid][1].request.status = RequestStatus.FINISHED_ABORTED
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            for cid in child_ids:
                _, seq = self.output_processor.seq_by_request_id[cid]
                self.output_processor.mark_finished(seq.request)
            self._pending_finished.update(child_ids)
            self.step_builder.forget(child_ids)

    def shutdown(self) -> None:
        """Stop the executor's worker processes, if any, and the KV connector (idempotent)."""
        self.executor.shutdown()
        for side in (self.kv_producer, self.kv_consumer):
            if side is not None:
                side.close()
        self.kv_producer = self.kv_consumer = None

    def has_unfinished_requests(self) -> bool:
        return (self.output_processor.num_unfinished > 0 or self.scheduler.has_unfinished_requests()
                or bool(self._in_flight) or (self.async_loop is not None and self.async_loop.in_flight is not None)
                or (self.kv_consumer is not None and self.kv_consumer.has_pending))

    # ------------------------------------------------------------------ disaggregation
    def _start_kv_transfer(self, config: DisaggConfig) -> None:
        cache = self.executor.runner.kv_cache  # the model runs in this process (EngineArgs.validate)
        connector = make_connector(config, self.transfer_stats)
        bytes_per_block = self.kv_spec.bytes_per_block
        if config.role == "prefill":
            self.kv_producer = KVProducer(connector, self.kv_manager, self.kv_layout, bytes_per_block,
                                          functools.partial(gather_blocks, cache), self.transfer_stats)
        else:
            self.kv_consumer = KVConsumer(connector, self.kv_manager, self.kv_layout, bytes_per_block,
                                          functools.partial(scatter_blocks, cache), self.transfer_stats,
                                          config.load_timeout_s, config.max_concurrent_loads)

    def _check_kv_transfer(self, params: SamplingParams, prompt_ids: list[int]
                           ) -> Union[None, RemoteDecodeRequest, KVTransferParams]:
        """The request's parsed ``kv_transfer_params``, checked against this instance's role
        and, for a decode hand-over, against the prompt and the KV layout it continues."""
        if params.kv_transfer_params is None:
            return None
        transfer = parse_kv_transfer_params(params.kv_transfer_params)
        role = self.args.kv_transfer.role if self.args.kv_transfer is not None else None
        wanted = "prefill" if isinstance(transfer, RemoteDecodeRequest) else "decode"
        if role != wanted:
            raise RequestRejected(f"kv_transfer_params for a {wanted} instance, but this one is "
                                  f"{'not disaggregated' if role is None else 'a ' + role + ' instance'} "
                                  f"(serve with --disaggregation-mode {wanted})")
        if params.n != 1 or params.prompt_logprobs is not None:
            raise RequestRejected("disaggregated requests take n = 1 and no prompt_logprobs")
        if isinstance(transfer, KVTransferParams):
            if transfer.connector != self.kv_consumer.connector.name:
                raise RequestRejected(f"the KV was published over the {transfer.connector!r} connector, "
                                      f"this instance uses {self.kv_consumer.connector.name!r}")
            if transfer.kv_layout != self.kv_layout:
                raise RequestRejected(f"the prefill instance's KV layout {transfer.kv_layout} is not this "
                                      f"instance's {self.kv_layout} (serve the same model and KV settings)")
            if (transfer.num_prompt_tokens != len(prompt_ids)
                    or transfer.prompt_digest != prompt_digest(prompt_ids)):
                raise RequestRejected("the prompt's tokens differ from those the prefill instance computed "
                                      "(a different model, tokenizer or chat template?)")
            if not 0 <= transfer.first_token_id < self.model_config.vocab_size:
                raise RequestRejected(f"kv_transfer_params.first_token_id {transfer.first_token_id} is "
                                      f"outside the vocabulary")
        return transfer

    def _publish_kv(self, request: Request) -> None:
        """A prefill instance's request finished (Scheduler.before_free: its blocks are still
        held): publish its KV when the decode side will go on from it."""
        ticket = request.kv_transfer
        if (self.kv_producer is None or not isinstance(ticket, RemoteDecodeRequest) or not request.output_token_ids
                or request.status is RequestStatus.FINISHED_ABORTED):
            return
        # The decode side goes on unless the first token already ended the request there.
        goes_on = (request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens < self.max_model_len
                   and (ticket.max_tokens is None or ticket.max_tokens > 1))
        seq = self.output_processor.seq_by_request_id.get(request.request_id)
        first_logprobs = None
        if seq is not None and seq[1].logprobs:
            first_logprobs = [FirstTokenLogprob(t, lp.logprob, lp.rank) for t, lp in seq[1].logprobs[0].items()]
        tables = self.kv_manager.get_block_tables(request.request_id) if goes_on else None
        try:
            params = self.kv_producer.params_for(request, tables, first_logprobs)
        except Exception:  # staging failed (shared memory full...): the decode side re-prefills
            logger.exception("request %s: publishing its KV failed; its decode instance will "
                             "recompute the prompt", request.request_id)
            params = self.kv_producer.params_for(request, None, first_logprobs)
        request.kv_transfer_result = params.to_json()

    def _add_received(self, request: Request, transfer: KVTransferParams) -> None:
        """A decode instance's request: the first token the prefill instance sampled is its
        first output at once; its KV, unless that token ended it, is fetched by the consumer
        and the request joins the running batch when it has arrived."""
        request.output_token_ids.append(transfer.first_token_id)
        logprobs = None
        if request.sampling_params.logprobs is not None and transfer.first_token_logprobs:
            logprobs = {e.token_id: Logprob(e.token_id, e.logprob, e.rank) for e in transfer.first_token_logprobs}
        stopped = self.output_processor.process_new_token(request, logprobs)
        status = (RequestStatus.FINISHED_STOPPED if self._advance_grammar(request) or stopped
                  else check_token_stop(request, self.max_model_len))
        self._pending_finished.add(request.request_id)  # the first token goes out with the next step
        if status is not None:
            request.status = status
            self.output_processor.mark_finished(request)
            self.kv_consumer.release_remote(transfer)
            return
        self.kv_consumer.add(request, transfer)

    def _admit_received(self, touched: set[str]) -> None:
        """Move the decode requests whose KV has arrived into the running batch, hand the ones
        whose transfer failed to the scheduler to be re-prefilled here, and start transfers
        for queued ones while sequence slots are free."""
        consumer = self.kv_consumer
        loaded, failed = consumer.poll()
        now = time.monotonic()
        for request in loaded:
            request.num_computed_tokens = request.num_prompt_tokens
            request.first_scheduled_time = request.first_scheduled_time or now
            self.scheduler.add_running(request)
            touched.add(request.request_id)
        for request, reason in failed:
            logger.warning("request %s: KV transfer failed (%s); re-prefilling it here", request.request_id, reason)
            request.num_computed_tokens = 0
            self.scheduler.add_request(request)
            touched.add(request.request_id)
        room = self.args.max_num_seqs - self.scheduler.num_running - consumer.num_loading
        if room > 0:
            consumer.start_loads(room)

    def release_transfer(self, transfer_id: str) -> bool:
        """A prefill instance drops a published transfer whose decode side will not come."""
        return self.kv_producer is not None and self.kv_producer.release(transfer_id)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run and apply one step; returns the outputs of the requests it touched.

        With pipeline stages (``num_micro_batches`` > 1) a step is submitted for every idle
        micro-batch that has work before the oldest step in flight is collected and applied:
        while the last stage runs one micro-batch, the first stage already runs the next.
        """
        t0 = time.perf_counter()
        apply_kernel_config(self.kernel_config)  # (another engine in this process may differ)
        touched: set[str] = set(self._pending_finished)
        self._pending_finished.clear()
        if self.kv_consumer is not None:
            self._admit_received(touched)
        stats = StepStats()
        if self.async_loop is not None:
            applied = self.async_loop.step(
                lambda sched, out: self._apply(sched, out, stats, touched, committed=True))
            return self._finish_step(t0, stats, touched, applied)
        # One micro-batch (no pipeline): submit, then collect the same step at once.
        busy = {mb for mb, _ in self._in_flight}
        for mb in range(self.num_micro_batches):
            if mb not in busy:
                sched = self._schedule(mb)
                if not sched.is_empty:
                    self.executor.submit(self._build(sched))
                    self._in_flight.append((mb, sched))
        done = None
        if self._in_flight:
            _, sched = self._in_flight.popleft()
            done = (sched, self.executor.collect())
        if done is not None:
            self._apply(*done, stats, touched)
        elif self.kv_consumer is not None and self.kv_consumer.num_loading and not touched:
            self.kv_consumer.wait(0.02)  # nothing to compute until a transfer lands: no busy loop
        return self._finish_step(t0, stats, touched, done is not None)

    def _finish_step(self, t0: float, stats: StepStats, touched: set[str], applied: bool) -> list[RequestOutput]:
        """The outputs of the requests a step touched, and the step's counters."""
        with label("detokenizer"):
            outputs = self.output_processor.outputs_for(touched)
        self.counters.finished_requests += sum(1 for o in outputs if o.finished)
        stats.duration_s = time.perf_counter() - t0
        if applied:
            self.counters.steps += 1
            if stats.num_prefill_tokens:
                self.counters.prefill_time_s += stats.duration_s
            else:
                self.counters.decode_time_s += stats.duration_s
            self.counters.step_history.append(stats)
            if len(self.counters.step_history) > 100_000:
                del self.counters.step_history[:50_000]
        return outputs

    def _schedule(self, micro_batch: int) -> SchedulerOutput:
        drafts = None
        if self.speculator is not None:
            with label("spec.propose"):
                drafts = self.speculator.propose(self.scheduler.running_in(micro_batch))
        with label("scheduler.schedule"):
            sched = self.scheduler.schedule(micro_batch, drafts)
        if self.speculator is not None and not sched.is_empty:
            with label("spec.draft_model"):
                self.speculator.fill(sched.chunks)  # a draft model proposes into its slots
        return sched

    def _build(self, sched: SchedulerOutput) -> StepInput:
        with label("executor.build_step"):
            return self.step_builder.build(sched)

    def _apply(self, sched: SchedulerOutput, runner_out: StepOutput, stats: StepStats,
               touched: set[str], committed: bool = False) -> None:
        """Apply a finished step's sampled tokens: stops, grammars, detokenizer, speculation.
        ``committed``: async scheduling counted the step's progress when it sent it."""
        stats.num_prefill_tokens = runner_out.num_prefill_tokens
        stats.num_decode_tokens = runner_out.num_decode_tokens
        stats.num_seqs = len(sched.chunks)
        logprobs = runner_out.logprobs
        num_appended = 0

        def on_token(req: Request, j: int) -> bool:
            # Detokenize each new token in order and advance its grammar; a stop string, or
            # a grammar that has reached its end, ends the request here.
            nonlocal num_appended
            num_appended += 1
            lps = logprobs.get(req.request_id)
            stop_string = self.output_processor.process_new_token(req, lps[j] if lps else None)
            return self._advance_grammar(req) or stop_string

        with label("scheduler.update"):
            updated = self.scheduler.update_from_output(sched, runner_out.sampled, on_token, committed=committed)
        for rid, entries in runner_out.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(rid, entries)
        touched.update(req.request_id for req in updated)
        self.step_builder.forget(req.request_id for req in updated if req.is_finished)
        if self.speculator is not None:
            updated_ids = {req.request_id for req in updated}  # not those aborted in flight
            for chunk in sched.chunks:
                rid = chunk.request.request_id
                if chunk.spec_token_ids and rid in updated_ids:
                    self.speculator.observe(rid, len(chunk.spec_token_ids), len(runner_out.sampled[rid]) - 1)
        self.counters.generation_tokens += num_appended

    @staticmethod
    def _advance_grammar(req: Request) -> bool:
        """Feed a constrained request's newest token to its grammar; True when the grammar has
        reached its end (nothing but EOS can follow) or refused the token: it finishes now."""
        if req.grammar is None:
            return False
        if not req.grammar.accept(req.output_token_ids[-1]):
            # Only reachable if every allowed token was masked away after the grammar
            # (e.g. min_tokens blocking the EOS it allowed): end rather than go off-grammar.
            logger.warning("request %s: sampled token refused by its grammar (%s); stopping",
                           req.request_id, req.grammar.error)
            return True
        return req.grammar.is_terminated

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        kv = self.kv_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_used": kv.num_used_blocks,
            "kv_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.counters.prompt_tokens,
            "generation_tokens": self.counters.generation_tokens,
            "aborted_requests": self.counters.aborted_requests,
            "rejected_requests": self.counters.rejected_requests,
            **self.spec_stats(),
            **self.transfer_stats_now(),
        }

    def transfer_stats_now(self) -> dict:
        """Disaggregation counters (kvserve.disagg.stats) and the staging and loading gauges.
        Safe from any thread: transfers move on the connector's threads, between steps too."""
        producer, consumer = self.kv_producer, self.kv_consumer
        return {**self.transfer_stats.snapshot(),
                "kv_transfers_staged": producer.connector.staging.num_staged if producer else 0,
                "kv_transfer_staged_bytes": producer.connector.staging.staged_bytes if producer else 0,
                "kv_transfers_in_flight": consumer.num_loading + consumer.num_queued if consumer else 0}

    def spec_stats(self) -> dict:
        """Speculative decoding totals: draft tokens verified, accepted, and the mean number
        of tokens a verify step yields (accepted drafts + 1); zeros when speculation is off."""
        st = self.speculator.stats if self.speculator is not None else None
        return {
            "spec_num_steps": st.num_spec_steps if st else 0,
            "spec_draft_tokens": st.num_draft_tokens if st else 0,
            "spec_accepted_tokens": st.num_accepted_tokens if st else 0,
            "spec_mean_accepted_length": st.mean_accepted_length if st else 0.0,
        }
