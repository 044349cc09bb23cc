"""Speculative decoding: drafters propose tokens, the target model verifies them in one pass.

The engine-side half lives here: ``ngram`` is the prompt-lookup drafter; ``speculator`` decides
per step and per request whether drafting pays (the "never a slowdown" policy) and returns the
step's drafts, which the engine hands to the scheduler (they travel in its output's chunks, never
on the requests); ``verify`` turns the target's sampled tokens at every drafted position into the
accepted run, and ``rejection`` verifies a draft model's samples at temperature > 0 against its
distribution q (both read by the runner). The model-side half, a draft model whose KV lives in
the target's blocks and which proposes after scheduling into the step's lookahead slots, sits
behind the executor (``kvserve/executor/draft_model.py``); the user's ``speculative_config``
is parsed in ``kvserve/config/speculative.py``. ``ngram``, ``speculator`` and ``verify`` are
torch-free.
"""
from kvserve.config.speculative import SpeculativeConfig, parse_speculative_config
from kvserve.speculative.speculator import Drafter, SpecStats, Speculator, build_speculator

__all__ = ["SpeculativeConfig", "parse_speculative_config", "Drafter", "SpecStats",
           "Speculator", "build_speculator"]
