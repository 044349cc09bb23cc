#!/usr/bin/env bash
# Regenerate every benchmark result for one model and the results table in README.md.
#
#   benchmarks/run_all.sh                       # SmolLM2-135M, all peers that are installed
#   MODEL=gemma-3-270m benchmarks/run_all.sh    # the sliding-window model
#
# Takes several minutes on a 2-core CPU; run it on a quiet machine (ratios are measured in
# the same run, so a busy machine skews absolute figures more than ratios).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-smollm2-135m-instruct}
EXTRA=${EXTRA:-}          # more engine flags, e.g. "--dtype bfloat16"
REPEATS=${REPEATS:-2}     # round-robin passes; each engine keeps its best
OUT=benchmarks/results/$MODEL
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

bench() { "$PY" -m kvserve.cli "$@" --model "$MODEL" $EXTRA --no-progress; }

# W1 mixed offline: every peer, sequential and batched.
bench bench throughput --workload W1 --compare hf,llamacpp --repeats "$REPEATS" --json "$OUT/W1.json" --plot "$OUT/W1.png"
# W2 decode-heavy: HF sequential would take ~10 minutes here and is dominated by HF batched.
bench bench throughput --workload W2 --compare hf-fp32-batch,llamacpp --repeats "$REPEATS" --json "$OUT/W2.json" --plot "$OUT/W2.png"
# W3 single stream + prefill sweep: sequential peers (nothing to batch).
bench bench latency --workload W3 --compare hf,llamacpp --repeats "$REPEATS" --json "$OUT/W3.json" --plot "$OUT/W3.png"
# W3 with int4 weights, for the memory-bound single stream: each model's GGUF blocks read as
# stored (SmolLM2's Q4_1; Gemma 3's Q5_0/Q8_0/Q4_K/Q6_K).
bench bench latency --workload W3 --quantization int4 --compare llamacpp --repeats "$REPEATS" \
    --json "$OUT/W3-int4.json" --plot "$OUT/W3-int4.png"
# W4 shared prefix: kvserve with and without prefix caching, and llama.cpp (its batched mode
# slows down sharply at this context length here, so the sequential one is run too).
bench bench throughput --workload W4 --compare kvserve-noprefix,llamacpp \
    --repeats "$REPEATS" --json "$OUT/W4.json" --plot "$OUT/W4.png"
# Where W1's time goes.
bench profile --workload W1 --trace "$OUT/W1-profile.trace.json" --json "$OUT/W1-profile.json"

"$PY" -m kvserve.bench.report "$OUT" --update-readme benchmarks/README.md --key "$MODEL"
