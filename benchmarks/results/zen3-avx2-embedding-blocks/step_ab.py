"""Decode steps with the token embedding (and the LM head's exact weights) as Q8_0 blocks
against the fp32 table: two engines in one process (the second built with
kvserve.quant.keep_embedding_as_blocks turned off), their requests alternated; each request a
256-token prompt and greedy tokens, `rows` at a time; the median step of each, then the median
of the per-round ratios. Tokens must agree.

    python step_ab.py MODEL none|int4 ROUNDS ROWS
"""
import statistics
import sys
import time

import kvserve.quant as quant
from kvserve.bench.workloads import load_text
from kvserve.llm import LLM
from kvserve.request import SamplingParams

model, quantization, rounds, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
blocks = LLM(model=model, quantization=quantization, kv_cache_memory=256 << 20)
keep = quant.keep_embedding_as_blocks
quant.keep_embedding_as_blocks = lambda m: 0
fp32 = LLM(model=model, quantization=quantization, kv_cache_memory=256 << 20)
quant.keep_embedding_as_blocks = keep
ids = blocks.engine.tokenizer.encode(load_text("summarize"))
medians = {"blocks": [], "fp32": []}
for r in range(rounds):
    tokens = {}
    for name, llm in (("blocks", blocks), ("fp32", fp32)) if r % 2 == 0 else (("fp32", fp32), ("blocks", blocks)):
        engine = llm.engine
        for i in range(rows):
            prompt = ids[r * 11 + i * 3: r * 11 + i * 3 + 256]
            engine.add_request(f"{name}{r}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
        engine.step()  # the prompts
        times, outs = [], {}
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            for o in engine.step():
                if o.finished:
                    outs[o.request_id.split("-")[1]] = o.outputs[0].token_ids
            times.append(time.perf_counter() - t)
        medians[name].append(statistics.median(times) * 1e3)
        tokens[name] = [outs[k] for k in sorted(outs)]
    assert tokens["blocks"] == tokens["fp32"], "the tokens differ"
ratios = [b / f for b, f in zip(medians["blocks"], medians["fp32"])]
print(f"{model} {quantization} rows {rows}: median step blocks {statistics.median(medians['blocks']):.3f} ms, "
      f"fp32 {statistics.median(medians['fp32']):.3f} ms; blocks / fp32 per round: median "
      f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); tokens identical")
