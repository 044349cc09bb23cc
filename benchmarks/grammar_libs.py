"""Compare the two grammar engines kvserve could use (llguidance, xgrammar) on SmolLM2's
49k-token vocabulary: tokenizer set-up, schema compile time, and per-token mask time while
walking a valid JSON document token by token (what the sampler pays per decode step).

    python benchmarks/grammar_libs.py            # needs llguidance; xgrammar if importable
"""
from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]},
        "score": {"type": "number"}}, "required": ["id", "tags", "address"]},
]
DOCS = [{"name": "Alice Smith", "age": 42},
        {"id": 7, "tags": ["a", "c", "b", "a"], "address": {"city": "Paris", "zip": "75001"},
         "score": 3.25}]


def main() -> None:
    from kvserve.config import DEFAULT_MODEL
    from kvserve.loader.resolve import resolve_model
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model(DEFAULT_MODEL).path)
    vocab = tok.vocab_size
    print(f"tokenizer: {tok.name}, vocab {vocab}; CPU: {_cpu()}")
    docs = [tok.encode(json.dumps(d), add_special_tokens=False) for d in DOCS]

    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok.hf, n_vocab=vocab)
    print(f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else ''}: "
          f"tokenizer set-up {1e3 * (time.perf_counter() - t0):.0f} ms")
    mask = llt.allocate_token_bitmask(1, vocab)
    for schema, ids in zip(SCHEMAS, docs):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        m = llguidance.LLMatcher(lltok, grammar)
        compile_ms = 1e3 * (time.perf_counter() - t0)
        times = []
        for t in ids:
            t1 = time.perf_counter()
            llt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t1)
            assert m.consume_token(t), m.get_error()
        _report("llguidance", schema, compile_ms, times, "cold")
        m.reset()
        times = []
        for t in ids:  # the same grammar again: what a cached grammar costs a later request
            t1 = time.perf_counter()
            llt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t1)
            assert m.consume_token(t), m.get_error()
        _report("llguidance", schema, None, times, "warm")

    try:
        import xgrammar as xgr
    except Exception as exc:  # not installed (it pulls triton on Linux)
        print(f"xgrammar: not importable ({exc})")
        return
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print(f"xgrammar {xgr.__version__ if hasattr(xgr, '__version__') else ''}: tokenizer set-up "
          f"{1e3 * (time.perf_counter() - t0):.0f} ms")
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for schema, ids in zip(SCHEMAS, docs):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        m = xgr.GrammarMatcher(compiled)
        compile_ms = 1e3 * (time.perf_counter() - t0)
        times = []
        for t in ids:
            t1 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - t1)
            assert m.accept_token(t)
        _report("xgrammar", schema, compile_ms, times, "cold")
        m = xgr.GrammarMatcher(compiled)
        times = []
        for t in ids:
            t1 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - t1)
            assert m.accept_token(t)
        _report("xgrammar", schema, None, times, "warm")


def _report(lib: str, schema: dict, compile_ms, times: list[float], label: str) -> None:
    head = f"compile {compile_ms:.1f} ms, " if compile_ms is not None else ""
    print(f"  {lib:10s} schema {len(json.dumps(schema))} chars ({label}): {head}"
          f"mask {1e6 * statistics.mean(times):.0f} us mean / "
          f"{1e6 * statistics.median(times):.0f} us median / {1e6 * max(times):.0f} us max "
          f"over {len(times)} tokens")


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
