"""Speculative decoding: drafters propose tokens, the target model verifies them in one pass.

``config`` parses the user's ``speculative_config``; ``ngram`` is the prompt-lookup drafter;
``draft_model`` drafts with a second model whose KV lives in the target's blocks (it
proposes after scheduling, into the step's lookahead slots); ``speculator`` decides per step
and per request whether drafting pays (the "never a slowdown" policy); ``verify`` turns the
target's sampled tokens at every drafted position into the accepted run, and ``rejection``
verifies a draft model's samples at temperature > 0 against its distribution q.
``config``, ``ngram``, ``speculator`` and ``verify`` are torch-free.
"""
from kvserve.spec.config import SpeculativeConfig, parse_speculative_config
from kvserve.spec.speculator import Drafter, SpecStats, Speculator, build_speculator

__all__ = ["SpeculativeConfig", "parse_speculative_config", "Drafter", "SpecStats",
           "Speculator", "build_speculator"]
