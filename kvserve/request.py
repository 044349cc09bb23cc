"""Request state, sampling parameters and the outputs handed back to callers.

Torch-free: the scheduler and KV manager work on these objects without importing torch.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional


class RequestRejected(ValueError):
    """A request that can never be served (too long, bad parameters). The message says why."""


class EngineBusy(RequestRejected):
    """The waiting queue is full: try again later (HTTP 429)."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None  # number of top alternatives to return (0: only the sampled)
    # Logprobs of the prompt's tokens (top alternatives as for logprobs); the first is None.
    prompt_logprobs: Optional[int] = None
    # A grammar the output must match (kvserve.structured.StructuredOutputsParams).
    structured_outputs: Optional[Any] = None
    skip_special_tokens: bool = True
    # Prefill/decode disaggregation (vLLM's name): {"do_remote_decode": true} on a prefill
    # instance, the prefill instance's answer on a decode instance (kvserve.disagg.params).
    kv_transfer_params: Optional[dict] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise RequestRejected with a one-line reason for any invalid value."""
        if self.n < 1:
            raise RequestRejected(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise RequestRejected(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestRejected(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestRejected(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestRejected(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise RequestRejected(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise RequestRejected(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise RequestRejected(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise RequestRejected(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestRejected("min_tokens must not exceed max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestRejected(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise RequestRejected(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if vocab_size is not None:
            for tok in list(self.logit_bias or {}) + list(self.stop_token_ids):
                if not 0 <= int(tok) < vocab_size:
                    raise RequestRejected(f"token id {tok} is outside the vocabulary (size {vocab_size})")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.value if self.is_finished else None


@dataclass
class Request:
    """One sequence being generated. ``n > 1`` requests are split into n of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    # For n > 1: the sibling whose prompt blocks this one waits to share via the prefix cache.
    prefix_leader: Optional["Request"] = None
    # Grammar state (kvserve.structured.grammar.GrammarState) when the output is constrained:
    # the sampler masks with it, the engine advances it with each accepted token.
    grammar: Any = None
    # Prompt logprobs computed so far ({token_id: Logprob} for prompt tokens 1, 2, ...), when
    # asked for; the prefix cache is bypassed until they are all computed.
    prompt_logprobs: Optional[list] = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens that steps already sent to the worker will sample for this
    # request, not yet known here. Its ``num_computed_tokens`` already counts the positions
    # those steps compute (kvserve/async_step.py); always 0 in the synchronous engine.
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first schedule)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Optional[Any] = None  # the stop string or token id that finished it
    num_preemptions: int = 0
    # Timing (monotonic seconds) for TTFT / TPOT / queue time.
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    # Chained hashes of this request's full blocks, filled by the KV manager as they fill.
    block_hashes: list = field(default_factory=list)
    # Pipeline parallelism: the micro-batch this request runs in (Scheduler.schedule(micro_batch)).
    micro_batch: int = 0
    # Disaggregation: the parsed kv_transfer_params (kvserve.disagg.params), and on a prefill
    # instance the params its finished output hands to the decode instance.
    kv_transfer: Any = None
    kv_transfer_result: Optional[dict] = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """The tokens the scheduler plans for: the known ones and those a step in flight will
        sample (the same as ``num_tokens`` without async scheduling)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_total_tokens(self) -> Optional[int]:
        mt = self.sampling_params.max_tokens
        return None if mt is None else self.num_prompt_tokens + mt


@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: Optional[int] = None
    decoded: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[Any] = None
    # One entry per generated token: {token_id: Logprob} holding the sampled token and the
    # top alternatives (None when logprobs were not asked for).
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    # Streaming: text and tokens added since the previous output for this request.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    # Per prompt token: None for the first, then {token_id: Logprob} (when asked for).
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    # A prefill instance's finished request: where its KV waits for the decode instance.
    kv_transfer_params: Optional[dict] = None
