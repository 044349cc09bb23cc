"""What the engine needs of an executor."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

from kvserve.executor.step import StepInput, StepOutput


class ExecutorError(RuntimeError):
    """The executor can no longer run steps (a worker died, hung or failed). The message
    says which and why; the engine cannot continue."""


class Executor(Protocol):
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step; raises ExecutorError when the model can no longer run."""
        ...

    def submit(self, step: StepInput) -> None:
        """Start one step without waiting for it (pipeline parallelism keeps one step per
        stage in flight); ``collect`` returns the results in submission order."""
        ...

    def collect(self) -> StepOutput:
        """The oldest submitted step's result, waiting for it."""
        ...

    def prompt_hidden_states(self, token_ids: list[int], chunk_size: int) -> torch.Tensor:
        """A prompt's final-norm hidden states [tokens, hidden] (executor/hidden_states.py),
        computed between steps without touching the KV pool; NotImplementedError where the
        model is split over processes."""
        ...

    def shutdown(self) -> None:
        """Release the model and stop any worker processes (idempotent)."""
        ...
