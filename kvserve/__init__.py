"""kvserve: a small, readable LLM inference engine and OpenAI-compatible server."""
import os

# numpy only builds small host-side arrays here; its OpenBLAS thread pool would otherwise
# spin beside torch's threads on the same cores. Set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from kvserve.request import RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    # Lazy: importing kvserve (e.g. for the torch-free scheduler) must not pull in torch.
    if name == "LLM":
        from kvserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvserve.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
