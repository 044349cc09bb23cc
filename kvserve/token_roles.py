"""A step's token roles: which rows are prompt tokens and which are generated ones.

A model with dual-format linear layers (int4 mode: ``Int4Linear`` with a bf16 copy of its
weights) computes prompt rows with the bf16 weights, which suit prefill (compute-bound), and
generated rows (and speculative drafts) with the 4-bit weights, which suit decode (bound by
the bytes read). The format follows the token's role, never the batch or the chunking, so a
request's results stay the same whatever step computes its tokens (issue #15): every prompt
row is bf16 wherever a chunk boundary falls, a generated token recomputed after preemption is
4-bit again.

The runner builds one ``TokenRoles`` per step and the model installs it for the decoder
layers (``use_token_roles``); the linear layers read it with ``current_token_roles``. A
context variable rather than an argument through every layer: the roles concern the linear
layers only, and the layers between them (attention, norms) stay as they are.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

import numpy as np
import torch

ALL_GENERATED, ALL_PROMPT, MIXED = 0, 1, 2  # decoder.cpp's TokenRoles::Kind, in the same order


class TokenRoles:
    """The roles of a step's ``num_rows`` rows. Pure steps (all prompt, all generated) carry
    no index tensors, so that they cost nothing; a mixed step carries the sorted rows of each
    role, and each role's contiguous run ``(start, length)`` when its rows form one (as when
    the decodes precede a prefill chunk): then no gather is needed for that role."""

    __slots__ = ("kind", "prompt_rows", "generated_rows", "prompt_run", "generated_run")

    def __init__(self, kind: int, prompt_rows: Optional[torch.Tensor] = None,
                 generated_rows: Optional[torch.Tensor] = None) -> None:
        self.kind = kind
        self.prompt_rows, self.generated_rows = prompt_rows, generated_rows
        self.prompt_run = _run(prompt_rows)
        self.generated_run = _run(generated_rows)

    @classmethod
    def from_mask(cls, is_prompt: np.ndarray, device: torch.device | str = "cpu",
                  num_prompt: Optional[int] = None) -> "TokenRoles":
        """From a boolean mask over the step's rows (True: a prompt position); ``num_prompt``, its
        count of True where the caller has it."""
        if num_prompt is None:
            num_prompt = int(is_prompt.sum())
        if num_prompt == 0:
            return cls(ALL_GENERATED)
        if num_prompt == len(is_prompt):
            return cls(ALL_PROMPT)
        prompt = torch.from_numpy(np.flatnonzero(is_prompt)).to(device)
        generated = torch.from_numpy(np.flatnonzero(~is_prompt)).to(device)
        return cls(MIXED, prompt, generated)

    def apply(self, x: torch.Tensor, prompt_fn: Callable[[torch.Tensor], torch.Tensor],
              generated_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``fn(x)`` row by row with each row's function (x: [rows, features]). The kernels
        reduce each row independently of the others in the call, so computing a role's rows
        apart gives each row the bits it would have in any other step."""
        if self.kind == ALL_PROMPT:
            return prompt_fn(x)
        if self.kind == ALL_GENERATED:
            return generated_fn(x)
        parts = ((self.prompt_rows, self.prompt_run, prompt_fn),
                 (self.generated_rows, self.generated_run, generated_fn))
        out: Optional[torch.Tensor] = None
        for rows, run, fn in parts:
            y = fn(x.narrow(0, run[0], run[1]) if run else x.index_select(0, rows))
            if out is None:
                out = y.new_empty(x.shape[0], y.shape[1])
            if run:
                out.narrow(0, run[0], run[1]).copy_(y)
            else:
                out.index_copy_(0, rows, y)
        return out

    def subset(self, rows: torch.Tensor) -> "TokenRoles":
        """The roles of ``rows`` of the step (sorted, distinct), renumbered 0.. in their order:
        the last decoder layer's rows past its attention (models/base.py, ``last_layer_rows``)."""
        if self.kind != MIXED:
            return self
        is_prompt = torch.isin(rows, self.prompt_rows)
        num_prompt = int(is_prompt.sum())
        if num_prompt == 0:
            return TokenRoles(ALL_GENERATED)
        if num_prompt == rows.numel():
            return TokenRoles(ALL_PROMPT)
        return TokenRoles(MIXED, torch.nonzero(is_prompt).flatten(), torch.nonzero(~is_prompt).flatten())


def _run(rows: Optional[torch.Tensor]) -> Optional[tuple[int, int]]:
    """(start, length) when the sorted distinct ``rows`` are consecutive, else None."""
    if rows is None or rows.numel() == 0:
        return None
    first, last = int(rows[0]), int(rows[-1])
    return (first, rows.numel()) if last - first + 1 == rows.numel() else None


_current: ContextVar[Optional[TokenRoles]] = ContextVar("kvserve_token_roles", default=None)


def current_token_roles() -> Optional[TokenRoles]:
    """The roles of the step being computed, or None (every row generated: the 4-bit
    weights, as for a draft model's forward or a direct call of the layers)."""
    return _current.get()


@contextmanager
def roles_of_rows(rows: Optional[torch.Tensor]) -> Iterator[None]:
    """Inside the block, the step's rows are ``rows`` of it (sorted, distinct; None: all of
    them), each keeping its role: for the last decoder layer's rows past its attention."""
    if rows is None:
        yield
        return
    roles = current_token_roles()
    with use_token_roles(None if roles is None else roles.subset(rows)):
        yield


@contextmanager
def use_token_roles(roles: Optional[TokenRoles]) -> Iterator[None]:
    """Install ``roles`` for the linear layers called inside the block."""
    token = _current.set(roles)
    try:
        yield
    finally:
        _current.reset(token)
