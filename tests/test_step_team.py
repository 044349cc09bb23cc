"""Step teams (csrc/step_team.h): a fused decoder step's kernels run their parallel work on
OpenMP threads started once for the step. The chunks must be at::parallel_for's, a chunk's
exception must reach the caller and leave the team usable, and a step must give the same bits
with teams on and off."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from kvserve import ops
from kvserve.loader import load_model, resolve_model

from test_fused_decoder import _three_steps

pytestmark = pytest.mark.skipif(os.environ.get("KVSERVE_CPU_OPS") == "0", reason="fused kernels disabled")


@pytest.fixture
def ext():
    ext = ops.load_extension()
    assert ext is not None
    return ext


@contextlib.contextmanager
def step_teams(ext, enabled: bool):
    before = ext.step_teams_enabled()
    ext.set_step_teams(enabled)
    try:
        yield
    finally:
        ext.set_step_teams(before)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_step_teams_are_on_by_default(ext):
    assert ext.step_teams_enabled() == (os.environ.get("KVSERVE_STEP_TEAM") != "0")


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
        for throw_on in (99, 0, 50):  # the helper's chunk, the leader's, the boundary's
            with pytest.raises(RuntimeError, match=r"chunk \[\d+, \d+\) of thread [01] threw"):
                ext.step_team_probe(100, 1, throw_on=throw_on)
            in_team, plain = ext.step_team_probe(100, 1)
            assert in_team == plain


def test_team_off_runs_plain_parallel_fors(ext):
    with threads(2), step_teams(ext, False):
        in_team, plain = ext.step_team_probe(64, 1)
    assert in_team == plain


@pytest.mark.parametrize("weight_format", [None, "int4"])
def test_fused_steps_are_the_same_bits_with_and_without_teams(ext, weight_format):
    """SmolLM2's real shapes (its layers split over the threads, attention's partitions
    merged): a prefill beside a short prompt, a mixed step and two decodes, teams on and off."""
    model, cfg = load_model(resolve_model("smollm2-135m-instruct"), quantization=weight_format)
    native = model.model.fused_layers
    assert native is not None and native.native.runs_in_step_team
    with threads(2):
        with step_teams(ext, True):
            teamed = _three_steps(model, cfg)
        with step_teams(ext, False):
            plain = _three_steps(model, cfg)
    assert torch.equal(teamed, plain)
