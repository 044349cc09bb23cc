#!/usr/bin/env bash
# Optional: the OpenVINO GenAI peer (`kvserve bench --compare openvino`) in its own virtualenv,
# .venv-openvino. openvino-genai and optimum-intel (which exports the model) want an older
# transformers than kvserve's, so they never share kvserve's .venv; the bench runs this venv's
# python as a child process. Idempotent: a second run with an unchanged script returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
venv=.venv-openvino
stamp=$venv/.kvserve-openvino-stamp
want="$(sha256sum scripts/setup_openvino.sh | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
[ -x $venv/bin/python ] || "$PY" -m venv $venv
$venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned (optimum's exporter traces the model with it): the CPU build of
# 2.13.0 lies on this machine's disk, where a plain `torch` would pull a multi-GB CUDA build.
$venv/bin/python -m pip install -q "torch==2.13.0"
# transformers 4.57: optimum-intel 2.2 takes 4.51-5.5, but exports the Gemma family only up
# to 5.0 ("Maximum required is 5.0"). gguf and accelerate let it read the GGUF files kvserve
# runs (their weights are exported, dequantized, from an HF directory).
$venv/bin/python -m pip install -q "torch==2.13.0" "transformers~=4.57.0" "optimum-intel[openvino]" \
    openvino-genai openvino-tokenizers gguf accelerate sentencepiece
# optimum-intel requires torchvision (for vision-language models only); PyPI's build of it is
# made for the CUDA torch and breaks transformers' imports beside the CPU one ("operator
# torchvision::nms does not exist"), and no CPU build is reachable here: text models need none.
$venv/bin/python -m pip uninstall -q -y torchvision
$venv/bin/python -c "import transformers.models.llama, optimum.exporters.openvino, openvino_genai; print('openvino-genai', openvino_genai.__version__)"
echo "$want" > "$stamp"
echo "kvserve: OpenVINO peer set-up done ($venv)"
