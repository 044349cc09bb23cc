"""Prometheus metrics of one server app, in their own registry (several apps may live in one
process, as they do in the tests).

Engine-side totals (tokens, prefix cache, preemptions, aborts, queue and KV gauges) are read
from ``engine.stats()`` as the engine thread last took it (after each step and each batch of
adds and aborts: a scrape never waits for a step), so they can never drift from the engine's
own bookkeeping; latency histograms are observed by the server when a request finishes.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvserve.request import RequestOutput

PREFIX = "kvserve:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                      0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

# engine.stats() key -> (metric name without prefix, help)
_GAUGES = {
    "num_running": ("num_requests_running", "Requests (sequences) in the running batch."),
    "num_waiting": ("num_requests_waiting", "Requests (sequences) waiting to be scheduled."),
    "kv_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."),
    "kv_blocks_used": ("kv_cache_blocks_used", "KV-cache blocks in use."),
    "kv_blocks_total": ("kv_cache_blocks_total", "KV-cache blocks in the pool."),
    "spec_mean_accepted_length": ("spec_decode_mean_accepted_length",
                                  "Speculative decoding: mean tokens per verify step (accepted drafts + 1)."),
    "kv_transfers_staged": ("kv_transfers_staged", "Prefill side: published KV transfers not yet fetched."),
    "kv_transfer_staged_bytes": ("kv_transfer_staged_bytes", "Prefill side: bytes of KV staged for decode instances."),
    "kv_transfers_in_flight": ("kv_transfers_in_flight",
                               "Decode side: requests whose KV is queued for or on its way from a prefill instance."),
}
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens admitted."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "num_preemptions": ("num_preemptions", "Requests preempted for lack of KV-cache blocks."),
    "aborted_requests": ("request_aborted", "Requests aborted (client went away, or abort)."),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens", "Speculative draft tokens verified."),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
    "spec_num_steps": ("spec_decode_num_drafts", "Verify steps that carried drafts (per request)."),
    "kv_transfers_published": ("kv_transfers_published", "Prefill side: KV transfers published."),
    "kv_transfer_published_bytes": ("kv_transfer_published_bytes", "Prefill side: bytes of KV published."),
    "kv_transfers_fetched": ("kv_transfers_fetched", "Prefill side: published transfers fetched by a decode side."),
    "kv_transfer_sent_bytes": ("kv_transfer_sent_bytes", "Prefill side: bytes of KV sent over TCP."),
    "kv_transfers_expired": ("kv_transfers_expired", "Prefill side: published transfers nobody fetched in time."),
    "kv_transfers_loaded": ("kv_transfers_loaded", "Decode side: KV transfers received."),
    "kv_transfer_received_bytes": ("kv_transfer_received_bytes", "Decode side: bytes of KV received."),
    "kv_transfer_received_blocks": ("kv_transfer_received_blocks", "Decode side: KV blocks received."),
    "kv_transfer_reused_blocks": ("kv_transfer_reused_blocks",
                                  "Decode side: prompt blocks not transferred, found in the local prefix cache."),
    "kv_transfers_failed": ("kv_transfers_failed",
                            "Decode side: KV transfers that failed (the request was re-prefilled locally)."),
}
# engine.stats() key -> (histogram name without prefix, help); values (cumulative buckets, sum, count).
_HISTOGRAMS = {
    "kv_transfer_load_seconds": ("kv_transfer_load_seconds",
                                 "Decode side: time from starting a KV transfer to its last block written."),
    "kv_transfer_publish_seconds": ("kv_transfer_publish_seconds",
                                    "Prefill side: time to copy a request's KV out of the pool and stage it."),
}


class _EngineStatsCollector:
    def __init__(self, stats: Callable[[], dict], server_rejections: Callable[[], float]) -> None:
        self._stats = stats
        self._server_rejections = server_rejections

    def describe(self) -> Iterator[Metric]:
        # Declared without values so that registering does not query the engine.
        for name, doc in _GAUGES.values():
            yield GaugeMetricFamily(PREFIX + name, doc)
        for name, doc in _COUNTERS.values():
            yield CounterMetricFamily(PREFIX + name, doc)
        yield CounterMetricFamily(PREFIX + "request_rejected", _REJECTED_HELP)
        for name, doc in _HISTOGRAMS.values():
            yield HistogramMetricFamily(PREFIX + name, doc)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0)))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0)))
        rejected = float(stats.get("rejected_requests", 0)) + self._server_rejections()
        yield CounterMetricFamily(PREFIX + "request_rejected", _REJECTED_HELP, value=rejected)
        for key, (name, doc) in _HISTOGRAMS.items():
            buckets, total, _ = stats.get(key, ([("+Inf", 0)], 0.0, 0))
            yield HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=total)


_REJECTED_HELP = ("Requests refused: invalid, too long, or the waiting queue was full "
                  "(by the engine or by the server before reaching it).")


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first output token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between successive tokens of a request, as delivered to the server.",
            buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Time from arrival to first being scheduled.",
            buckets=_REQUEST_BUCKETS, registry=r)
        self.request_success = Counter(
            PREFIX + "request_success", "Requests finished, by finish reason.",
            ["finished_reason"], registry=r)
        self._server_rejections = 0
        r.register(_EngineStatsCollector(engine_stats, lambda: float(self._server_rejections)))

    def count_server_rejection(self) -> None:
        """A request refused before it reached the engine (the engine counts its own)."""
        self._server_rejections += 1

    def observe_token_gap(self, seconds: float, num_tokens: int) -> None:
        """One delivered output carrying ``num_tokens`` new tokens, ``seconds`` after the previous."""
        if num_tokens > 0:
            per_token = seconds / num_tokens
            for _ in range(num_tokens):
                self.inter_token_latency.observe(per_token)

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is not None:
            if m.ttft is not None:
                self.time_to_first_token.observe(m.ttft)
            if m.tpot is not None:
                self.time_per_output_token.observe(m.tpot)
            if m.e2e_latency is not None:
                self.e2e_latency.observe(m.e2e_latency)
            if m.queue_time is not None:
                self.queue_time.observe(m.queue_time)
        for completion in output.outputs:
            self.request_success.labels(finished_reason=completion.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
