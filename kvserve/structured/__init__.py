"""Structured outputs: a request's grammar (JSON schema, regex, choice, Lark/GBNF) compiled
once per distinct spec, and a per-sequence state that the sampler reads a token mask from and
that accepts each sampled token (``params``: the torch-free request field; ``grammar``: the
llguidance-backed compiler and state)."""
from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
