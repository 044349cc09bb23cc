"""The CLI end to end on the real default model (subprocesses, as a user runs it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def kvserve(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def test_generate_streams_to_terminal():
    res = kvserve("generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.strip()) > 0
    assert "KV cache:" in res.stderr and "blocks" in res.stderr
    assert "8 generated" in res.stderr or "finish=" in res.stderr


def test_generate_batch_jsonl(tmp_path):
    inp = tmp_path / "prompts.jsonl"
    rows = [{"id": "a", "prompt": "Hello, my name is"},
            {"id": "b", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4},
            {"id": "c", "prompt_token_ids": [1, 2, 3, 4, 5]}]
    inp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    res = kvserve("generate", "--input", str(inp), "--output", str(out), "--max-tokens", "6")
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert len(records[1]["outputs"][0]["token_ids"]) <= 4
    assert all(r["outputs"][0]["finish_reason"] in ("stop", "length") for r in records)
    assert "tok/s" in res.stderr


def test_chat_interactive():
    res = kvserve("chat", "--max-tokens", "8", stdin="What is 2+2?\n\n")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.strip()) > 0


def test_clear_errors_not_tracebacks(tmp_path):
    res = kvserve("generate", "hi", "--model", "no-such-model")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "no-such-model" in res.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    res = kvserve("generate", "--input", str(bad), "--model", "tiny-llama")
    assert res.returncode == 2 and "bad.jsonl:1" in res.stderr and "Traceback" not in res.stderr
    res = kvserve("chat", "--model", "gemma-3-270m", stdin="hi\n")
    assert res.returncode == 2 and "chat template" in res.stderr
