"""Today's path behind the seam: the model runs in the engine's process, no copies made."""
from __future__ import annotations

from collections import deque

import torch

from kvserve.config import ModelConfig
from kvserve.executor.hidden_states import prompt_hidden_states
from kvserve.executor.step import StepInput, StepOutput
from kvserve.kv_cache import KVCacheSpec
from kvserve.executor.runner import ModelRunner


class UniProcExecutor:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, kv_spec: KVCacheSpec,
                 num_blocks: int, device: torch.device) -> None:
        self.runner = ModelRunner(model, model_config, kv_spec, num_blocks, device)
        self._done: deque[StepOutput] = deque()

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def submit(self, step: StepInput) -> None:
        # One process has nothing to overlap with: run it now.
        self._done.append(self.runner.execute(step))

    def collect(self) -> StepOutput:
        return self._done.popleft()

    def prompt_hidden_states(self, token_ids: list[int], chunk_size: int) -> torch.Tensor:
        runner = self.runner
        return prompt_hidden_states(runner.model, runner.kv_cache.spec, token_ids, runner.device,
                                    chunk_size, runner.wants_token_roles)

    def shutdown(self) -> None:
        pass
