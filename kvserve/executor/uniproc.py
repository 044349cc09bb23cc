"""Today's path behind the seam: the model runs in the engine's process, no copies made."""
from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.executor.step import StepInput, StepOutput
from kvserve.kv_cache import KVCacheSpec
from kvserve.runner import ModelRunner


class UniProcExecutor:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, kv_spec: KVCacheSpec,
                 num_blocks: int, device: torch.device) -> None:
        self.runner = ModelRunner(model, model_config, kv_spec, num_blocks, device)

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def shutdown(self) -> None:
        pass
