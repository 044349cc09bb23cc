"""kvserve: a small, readable LLM inference engine and OpenAI-compatible server."""
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
