#!/usr/bin/env bash
# Issue 63's table for one model, one run: kvserve's default mode and int4 mode, OpenVINO
# GenAI int4 (and int8), llama.cpp Q4_0; W1 and W2 (llama.cpp batched), W3 (llama.cpp one
# request at a time) with the decode bandwidth figures, and kvserve's profile of each mode.
#
#   bash scripts/setup_openvino.sh                          # once: the OpenVINO venv
#   OUT=benchmarks/results/<cpu>-openvino benchmarks/openvino_compare.sh
#   MODEL=gemma-3-270m OPENVINO=openvino OUT=... benchmarks/openvino_compare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-smollm2-135m-instruct}
OPENVINO=${OPENVINO:-openvino,openvino-int8}   # the OpenVINO peers (int8 costs one more export)
REPEATS=${REPEATS:-1}
OUT=${OUT:?set OUT to the results folder}/$MODEL
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

bench() { "$PY" -m kvserve.cli "$@" --model "$MODEL" --no-progress; }

# Export first: minutes on a busy machine, longer than a peer's start-up may take.
formats=int4; [[ "$OPENVINO" == *int8* ]] && formats=int4,int8
"$PY" -m kvserve.bench.openvino_export --model "$MODEL" --format "$formats"

bench bench throughput --workload W1 --compare "kvserve-int4,$OPENVINO,llamacpp-q4_0-batch" \
    --repeats "$REPEATS" --json "$OUT/W1.json"
bench bench throughput --workload W2 --compare "kvserve-int4,$OPENVINO,llamacpp-q4_0-batch" \
    --repeats "$REPEATS" --json "$OUT/W2.json"
bench bench latency --workload W3 --prefill-lens 512 --compare "kvserve-int4,$OPENVINO,llamacpp-q4_0-seq" \
    --repeats "$REPEATS" --json "$OUT/W3.json"
# Decode at the memory limit in each mode (the profile's unprofiled probe), W3-shaped.
bench profile --workload W3 --output-len 32 --trace "" --json "$OUT/profile-default.json"
bench profile --workload W3 --output-len 32 --quantization int4 --trace "" --json "$OUT/profile-int4.json"
