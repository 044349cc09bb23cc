"""Benchmarks and profiling: ``kvserve bench throughput | latency | serve`` and ``kvserve profile``.

Every engine in a comparison (kvserve and its peers) runs the same token ids, greedily, with
EOS ignored, timed the same way (``RequestTiming``), so the printed ratios compare like
with like.
"""
