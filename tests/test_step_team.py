"""Step teams (csrc/step_team.h): a fused decoder step's kernels run their parallel work on
OpenMP threads started once for the step. The chunks must be at::parallel_for's, a chunk's
exception must reach the caller and leave the team usable, and a step must give the same bits
with teams on and off."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading

import pytest
import torch

from kvserve import ops
from kvserve.llm import LLM
from kvserve.loader import load_model, resolve_model
from kvserve.request import SamplingParams

from test_fused_decoder import _three_steps

pytestmark = pytest.mark.skipif(ops.load_extension() is None, reason="fused kernels disabled")


@pytest.fixture
def ext():
    ext = ops.load_extension()
    assert ext is not None
    return ext


@contextlib.contextmanager
def _setting(get, set_, value):
    """``set_(value)`` for the block, the value ``get()`` gave before restored after it."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def step_teams(ext, enabled: bool):
    return _setting(ext.step_teams_enabled, ext.set_step_teams, enabled)


def threads(n: int):
    return _setting(torch.get_num_threads, torch.set_num_threads, n)


def test_step_teams_are_on_by_default(ext):
    assert ext.step_teams_enabled()


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("n, grain", [(1, 1), (2, 1), (7, 1), (7, 3), (100, 16), (100, 99), (100, 100), (5, 0)])
def test_team_chunks_are_parallel_fors(ext, num_threads, n, grain):
    """Every index runs once, on the thread at::parallel_for gives it (the split a kernel's
    bits may depend on), also with more threads than cores; a parallel_for inside a chunk runs
    where at::parallel_for's would (on the chunk's thread, or split where the outer call ran
    inline)."""
    with threads(num_threads), step_teams(ext, True):
        in_team, plain = ext.step_team_probe(n, grain)
        assert in_team == plain
        assert -1 not in in_team
        assert (len(set(in_team)) > 1) == (n > grain and n > 1)
        in_team, plain = ext.step_team_probe(n, grain, nested=True)
        assert in_team == plain


def test_team_chunk_exceptions_reach_the_caller_and_the_team_goes_on(ext):
    """A chunk that throws, on a helper thread or the leader's, is rethrown from the team's
    call as a RuntimeError with its message; the next team call works."""
    with threads(2), step_teams(ext, True):
        for throw_on, thread in ((99, 1), (0, 0), (50, 1)):  # the helper's chunk, the leader's, the boundary
            with pytest.raises(RuntimeError, match=rf"chunk \[\d+, \d+\) of thread {thread} threw"):
                ext.step_team_probe(100, 1, throw_on=throw_on)
            in_team, plain = ext.step_team_probe(100, 1)
            assert in_team == plain


def test_an_exception_outside_any_chunk_releases_the_helpers():
    """The leader's own code throwing (a TORCH_CHECK between kernel calls) ends the region: the
    helpers are released, the caller gets the error, the next team forms. In a child process
    with a timeout, since helpers left waiting would hang."""
    script = (
        "import torch\n"
        "from kvserve import ops\n"
        "ext = ops.load_extension(); torch.set_num_threads(2); ext.set_step_teams(True)\n"
        "formed = ext.step_teams_formed()\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        ext.step_team_probe(64, 1, throw_after=True)\n"
        "        raise SystemExit('no error')\n"
        "    except RuntimeError as e:\n"
        "        assert 'the body threw after its parallel call' in str(e), e\n"
        "    in_team, plain = ext.step_team_probe(64, 1)\n"
        "    assert in_team == plain\n"
        "assert ext.step_teams_formed() == formed + 6\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_team_off_runs_plain_parallel_fors(ext):
    with threads(2), step_teams(ext, False):
        formed = ext.step_teams_formed()
        in_team, plain = ext.step_team_probe(64, 1, require_team=False)
        assert ext.step_teams_formed() == formed
    assert in_team == plain


def test_callers_on_two_threads_share_out_the_team(ext):
    """Two Python threads at once (the probe runs without the GIL): one leads the team, the
    other runs its own OpenMP regions; both get at::parallel_for's chunks, none waits forever."""
    results, errors = [], []

    def call(n):
        try:
            for _ in range(200):
                results.append(ext.step_team_probe(n, 1, require_team=False))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with threads(2), step_teams(ext, True):
        workers = [threading.Thread(target=call, args=(n,)) for n in (37, 64)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
    assert not any(worker.is_alive() for worker in workers)
    assert not errors
    assert len(results) == 400 and all(in_team == plain for in_team, plain in results)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("weight_format", [None, "int4"])
def test_fused_steps_are_the_same_bits_with_and_without_teams(ext, weight_format, num_threads):
    """SmolLM2's real shapes (its layers split over the threads, attention's partitions
    merged): a prefill beside a short prompt, a mixed step and two decodes, teams on and off."""
    model, cfg = load_model(resolve_model("smollm2-135m-instruct"), quantization=weight_format)
    native = model.model.fused_layers
    assert native is not None and native.native.runs_in_step_team
    with threads(num_threads):
        with step_teams(ext, True):
            formed = ext.step_teams_formed()
            teamed = _three_steps(model, cfg)
            assert ext.step_teams_formed() == formed + 3  # one per step
        with step_teams(ext, False):
            plain = _three_steps(model, cfg)
            assert ext.step_teams_formed() == formed + 3
    assert torch.equal(teamed, plain)


def test_multi_step_rounds_are_the_same_with_and_without_teams(ext):
    """A round's steps in one native call (decode_round: one team for the round, the nested
    forward in it, the GIL released once): the same tokens and logprobs-free greedy text as the
    same engine without teams."""
    llm = LLM(model="smollm2-135m-instruct", quantization="int4", kv_cache_memory=32 << 20, num_scheduler_steps=8)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True)
    with threads(2):
        outs = {}
        for enabled in (True, False):
            with step_teams(ext, enabled):
                formed = ext.step_teams_formed()
                outs[enabled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                assert (ext.step_teams_formed() > formed) == enabled
    assert outs[True] == outs[False]
    assert all(len(tokens) == 37 for tokens in outs[True])
