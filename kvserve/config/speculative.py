"""``speculative_config``: the same keys as vLLM's, from a dict or a JSON string."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from kvserve.errors import ConfigError

METHODS = ("ngram", "draft_model")
# Keys holding strings; every other key but "method" is an integer.
_STRING_KEYS = ("model", "quantization")
WEIGHT_FORMATS = ("bf16", "int8", "int4")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: drafts verified per step, at most
    # n-gram drafter: match the last n tokens (longest n first) anywhere earlier in the
    # request's prompt and output, and propose the k tokens that followed the match.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Never a slowdown: no drafting while more requests than this are decoding (a batch
    # that large is compute-bound, verifying drafts costs what they save, or more).
    disable_by_batch_size: int = 4
    # Per request: after a verify step that accepted nothing, skip drafting for 1, 2, 4...
    # steps (up to this many); any accepted draft resets it. 0 disables the back-off.
    max_backoff_steps: int = 32
    # draft_model: the drafter, any model kvserve loads (a name, a .gguf, an HF directory)
    # with the target's tokenizer, and its linear weight format (default: the target's).
    model: Optional[str] = None
    quantization: Optional[str] = None

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; use one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ConfigError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size < 1:
            raise ConfigError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.max_backoff_steps < 0:
            raise ConfigError(f"max_backoff_steps must be >= 0, got {self.max_backoff_steps}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('speculative method "draft_model" needs a "model" (a name, a .gguf '
                              'file or an HF directory sharing the target\'s tokenizer)')
        if self.method != "draft_model" and (self.model is not None or self.quantization is not None):
            raise ConfigError(f'"model" and "quantization" are draft_model keys; method is {self.method!r}')
        if self.quantization not in (None, "none", *WEIGHT_FORMATS):
            raise ConfigError(f"unknown draft quantization {self.quantization!r}; use {', '.join(WEIGHT_FORMATS)}")


def parse_speculative_config(value: Union[None, str, dict, SpeculativeConfig]) -> Optional[SpeculativeConfig]:
    """None, a dict, a JSON object string, or a config -> a validated config (or None)."""
    if value is None or isinstance(value, SpeculativeConfig):
        if value is not None:
            value.validate()
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError("speculative_config must be a JSON object, e.g. "
                          '{"method": "ngram", "num_speculative_tokens": 4}')
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown speculative_config key(s): {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    if "method" not in value:
        raise ConfigError('speculative_config needs a "method" (e.g. "ngram")')
    kwargs: dict[str, Any] = dict(value)
    for name in _STRING_KEYS:
        if kwargs.get(name) is not None and not isinstance(kwargs[name], str):
            raise ConfigError(f"speculative_config {name} must be a string, got {kwargs[name]!r}")
    for name in known - {"method", *_STRING_KEYS}:
        if name in kwargs and (not isinstance(kwargs[name], int) or isinstance(kwargs[name], bool)):
            raise ConfigError(f"speculative_config {name} must be an integer, got {kwargs[name]!r}")
    config = SpeculativeConfig(**kwargs)
    config.validate()
    return config
