"""lm-evaluation-harness against the server, as its users run it: the ``local-completions``
model scores a small local multiple-choice task (tests/data/lm_eval) through
``/v1/completions`` with ``echo`` and ``logprobs`` (prompt logprobs, the first one null).

The real default model in fp32, so the answers mean something: ten easy cloze questions.
lm-eval tokenizes the requests itself (to find where each continuation starts): it gets the
server's own tokenizer, saved to a local directory, since nothing here can reach the Hub.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import track_engine
from kvserve.async_engine import AsyncLLMEngine
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.server.app import create_app
from test_server import ServerThread

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev extra (pip install -e .[dev])")

MODEL = "smollm2-135m-instruct"
TASK_DIR = Path(__file__).parent / "data" / "lm_eval"


def test_lm_eval_local_completions_loglikelihood(tmp_path):
    from lm_eval.tasks import TaskManager

    engine = LLMEngine(EngineArgs(model=MODEL, dtype="float32", quantization="none",
                                  kv_cache_memory=32 << 20))
    track_engine(engine)
    tokenizer_dir = tmp_path / "tokenizer"
    engine.tokenizer.hf.save_pretrained(tokenizer_dir)
    async_engine = AsyncLLMEngine(engine)
    try:
        with ServerThread(create_app(async_engine, MODEL)) as server:
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={"model": MODEL, "base_url": server.url + "/v1/completions",
                            "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir),
                            "tokenized_requests": True, "max_length": engine.max_model_len,
                            "num_concurrent": 1, "max_retries": 1},
                tasks=["kvserve_cloze"],
                task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
                log_samples=True, bootstrap_iters=0, random_seed=0)
    finally:
        async_engine.shutdown()

    scores = results["results"]["kvserve_cloze"]
    print("lm-eval kvserve_cloze:", scores)
    samples = results["samples"]["kvserve_cloze"]
    assert len(samples) == 10
    # Every choice was scored with a finite loglikelihood (echoed prompt logprobs).
    for sample in samples:
        for loglikelihood, _is_greedy in sample["filtered_resps"]:
            assert loglikelihood < 0 and loglikelihood > -100
    # Chance is 25 %; SmolLM2-135M gets these easy ones (10/10 when recorded, acc_norm 7/10).
    assert scores["acc,none"] >= 0.7, scores
