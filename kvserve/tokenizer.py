"""Text in and out: the tokenizer (with chat template), incremental detokenization and stop
strings.

The tokenizer is an HF fast tokenizer. For a GGUF file transformers rebuilds it from the
file's metadata, which takes seconds (tens for a 262k vocabulary), so the converted
tokenizer is saved once under ``~/.cache/kvserve/tokenizers/`` and loaded from there after.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from kvserve.config import ConfigError
from kvserve.request import RequestRejected

if TYPE_CHECKING:
    from kvserve.loader.resolve import ModelSource

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kvserve" / "tokenizers"

# Tokens that end a turn or a document in common chat formats. Like llama.cpp, generation
# stops on any of them that the vocabulary has as a special token, not only on the EOS id.
END_OF_GENERATION_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>",
                            "<|end|>", "<|endoftext|>", "<|end_of_text|>")

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """An HF fast tokenizer plus what the engine needs from it (EOS set, chat template)."""

    def __init__(self, hf, name: str = "", extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf
        self.name = name or Path(str(getattr(hf, "name_or_path", "") or "model")).name
        self.vocab_size: int = len(hf)
        self.bos_token_id: Optional[int] = hf.bos_token_id
        self.eos_token_ids: list[int] = self._find_eos_token_ids(extra_eos_token_ids)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str, cache_dir: Optional[str | Path] = None) -> "Tokenizer":
        """Build from a GGUF file's metadata, through a conversion cached on disk."""
        gguf_path = Path(path).expanduser().resolve()
        if not gguf_path.is_file():
            raise ConfigError(f"model file not found: {path}")
        cache_root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
        cached = cache_root / _gguf_cache_key(gguf_path)
        name = gguf_path.stem
        if (cached / "tokenizer.json").is_file():
            try:
                return cls(_load_hf_dir(cached, converted=True), name=name)
            except Exception:
                # A cache written by an incompatible version: convert again.
                shutil.rmtree(cached, ignore_errors=True)
        _convert_gguf_tokenizer(gguf_path, cached)
        # Load what was saved (not the in-memory conversion) so the first load behaves
        # exactly like every later, cached one.
        return cls(_load_hf_dir(cached, converted=True), name=name)

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        """Load from an HF model directory (tokenizer.json, tokenizer_config.json...)."""
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise ConfigError(f"tokenizer directory not found: {path}")
        return cls(_load_hf_dir(directory), name=directory.name,
                   extra_eos_token_ids=_generation_config_eos_ids(directory))

    def _find_eos_token_ids(self, extra: Sequence[int]) -> list[int]:
        ids: list[int] = []
        if self.hf.eos_token_id is not None:
            ids.append(self.hf.eos_token_id)
        ids.extend(extra)
        special = {tok.content: tok_id for tok_id, tok in self.hf.added_tokens_decoder.items()
                   if tok.special}
        ids.extend(special[t] for t in END_OF_GENERATION_TOKENS if t in special)
        return list(dict.fromkeys(ids))  # dedupe, keep order

    # ---- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens)
        bos = self.bos_token_id
        # A prompt that already starts with the BOS text (e.g. rendered by a chat template)
        # would otherwise get a second BOS from the tokenizer's post-processor.
        if (add_special_tokens and bos is not None and len(ids) >= 2 and ids[0] == bos
                and ids[1] == bos and text.startswith(self.hf.bos_token)):
            ids = ids[1:]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: it would change text depending on where a decode window
        # starts, and the incremental detokenizer must agree with a full decode.
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(token_ids))

    # ---- chat ---------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """Render messages to the prompt text. The text already carries the template's
        special tokens: encode it with ``add_special_tokens=False`` (or use encode_chat)."""
        if not self.has_chat_template:
            raise ConfigError(f"model {self.name} has no chat template; use a completion request")
        import jinja2

        try:
            return self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               **template_kwargs)
        except jinja2.TemplateError as e:  # e.g. the template rejects the role order
            raise RequestRejected(f"chat template error: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat prompt, as HF's ``apply_chat_template(tokenize=True)``."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)


def _gguf_cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    # The transformers version is part of the key: its GGUF conversion may change. (Read from
    # the package's metadata: importing transformers for it took ~1 s of a start.)
    key = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{importlib.metadata.version('transformers')}"
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def _load_hf_dir(directory: Path, converted: bool = False, **kwargs):
    """The directory's HF tokenizer: a copy of this process's earlier load of the same files
    when there is one (transformers takes 4-6 s over Gemma 3's 262k-token vocabulary, at every
    engine start-up: a draft model beside its target, one engine per test). ``converted``: the
    directory is this module's own save of a GGUF conversion (_load_converted_dir)."""
    key = (str(Path(directory).resolve()), _files_signature(directory), converted, tuple(sorted(kwargs.items())))
    loaded = _LOADED_TOKENIZERS.get(key)
    if loaded is None:
        if converted:
            loaded = _load_converted_dir(Path(directory))
        else:
            from transformers import AutoTokenizer

            loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, **kwargs)
        _LOADED_TOKENIZERS[key] = loaded
        while len(_LOADED_TOKENIZERS) > 4:
            _LOADED_TOKENIZERS.pop(next(iter(_LOADED_TOKENIZERS)))
    # A shallow copy: its own attributes (an engine may set its chat template), the same
    # immutable Rust tokenizer underneath.
    return copy.copy(loaded)


_LOADED_TOKENIZERS: dict[tuple, Any] = {}


def _load_converted_dir(directory: Path):
    """A converted GGUF tokenizer as a generic fast tokenizer over its tokenizer.json, which
    holds the whole pipeline (normalizer, pre-tokenizer, post-processor, decoder, added tokens).
    AutoTokenizer would build the class the config names (GemmaTokenizer), whose ``__init__``
    parses the JSON again in Python and rebuilds the 262k-token BPE from its vocabulary and
    merges: 2.9-3.1 s for Gemma 3, against ~1.3 s for the Rust parse alone. test_tokenizer
    checks the result against transformers' own GGUF tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text())
    # The class name and load-time flags are about how the files were written, not the tokenizer.
    # add_bos/eos_token and the added tokens are in tokenizer.json's post-processor and token list
    # (from_pretrained drops the flags there too; the constructor would rewrite the post-processor).
    for key in ("tokenizer_class", "backend", "is_local", "local_files_only", "name_or_path",
                "add_bos_token", "add_eos_token", "added_tokens_decoder", "init_inputs"):
        config.pop(key, None)
    template = directory / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text()
    try:
        config = PreTrainedTokenizerFast.convert_added_tokens(config, save=False)
        return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                       name_or_path=str(directory), **config)
    except Exception as e:  # a config this way cannot read: transformers' own, slower way
        logger.warning("tokenizer %s: generic load failed (%s); loading with AutoTokenizer", directory, e)
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _files_signature(directory: Path) -> tuple:
    """(name, size, mtime) of each file in ``directory``: any change to them loads again."""
    stats = ((p.name, p.stat()) for p in Path(directory).iterdir() if p.is_file())
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def _convert_gguf_tokenizer(gguf_path: Path, target: Path) -> None:
    """Convert with transformers and save to ``target`` atomically (rename of a finished
    directory), so concurrent processes never see half a cache entry."""
    try:
        hf = _load_hf_dir(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:  # not a GGUF, or a tokenizer type transformers cannot convert
        raise ConfigError(f"cannot build a tokenizer from {gguf_path}: {e}") from e
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        hf.save_pretrained(str(staging))
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "tokenizer.json").is_file():
                raise
            # Another process finished first; its copy is equivalent.
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _generation_config_eos_ids(directory: Path) -> list[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive, emitting only complete characters.

    Each step decodes a short window: the tokens since the previous emission (``read_offset``)
    plus the few before them (``prefix_offset``) for context, and emits what the new tokens
    add. The window resets after every emission, so a step costs O(1), not O(length). Text
    ending in U+FFFD is a multi-byte character split across tokens: it waits for the rest.
    """

    # Prompt tokens decoded as left context for the first output tokens, so that a
    # tokenizer whose decoder strips a leading space does not strip the first word's.
    PROMPT_CONTEXT_TOKENS = 5
    # A window this many tokens past the last emission is not an unfinished character (at
    # most 4 bytes): it is an invalid byte sequence or a run of skipped special tokens. It is
    # flushed as is so the decode window, and so the cost per token, stays bounded.
    MAX_PENDING_TOKENS = 16

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: Optional[Sequence[int]] = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-self.PROMPT_CONTEXT_TOKENS:]
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # a prompt cut mid-character would make the text diff misalign
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (complete characters only)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        out = []
        for tok in token_ids:
            self._ids.append(int(tok))
            out.append(self._step(force=False))
        return self._emit("".join(out))

    def finish(self) -> str:
        """Emit whatever is still held back (an unfinished character at the very end), so
        that ``text`` equals a full decode of the generated ids."""
        return self._emit(self._step(force=True))

    def _step(self, force: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        overdue = len(self._ids) - self._read_offset >= self.MAX_PENDING_TOKENS
        if new_text.endswith(_REPLACEMENT_CHAR) and not (force or overdue):
            return ""  # the rest of a multi-byte character is still to come
        if len(new_text) <= len(prefix_text) and not overdue:
            return ""  # nothing visible yet (e.g. a skipped special token): widen the window
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _emit(self, delta: str) -> str:
        if delta:
            self._text_parts.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopStringMatcher:
    """Finds stop strings in generated text and says how much of a stream is safe to show.

    ``check`` is called after each detokenizer step with the full text and the length of the
    newly added part; it only searches where a new match can be (a stop string may straddle
    the old and new text).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]
        self.include_stop_str_in_output = include_stop_str_in_output

    def check(self, text: str, num_new_chars: int) -> Optional[tuple[str, str]]:
        """``(stop_string, truncated_text)`` for the earliest occurrence of any stop string
        (the first listed wins a tie), or None. The truncated text ends before the stop
        string (after it, when included)."""
        if not self.stop or num_new_chars <= 0:
            return None
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            # Only an occurrence that ends in the new text: one finished before it (while
            # min_tokens held the check back) is not a stop, as in vLLM.
            idx = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        end = idx + len(s) if self.include_stop_str_in_output else idx
        return s, text[:end]

    def safe_emit_length(self, text: str) -> int:
        """Length of the prefix of ``text`` that can be streamed now: everything except a
        tail that could still grow into a stop string (the longest suffix that is a proper
        prefix of one). Call only while the request is unfinished; once stopped, the
        truncated text is final."""
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return len(text) - hold


def load_tokenizer(source: "ModelSource") -> Tokenizer:
    """The tokenizer of a resolved model: the GGUF's own, the HF directory's files, or for the
    random-weight test models SmolLM2's."""
    from kvserve.loader.resolve import DEFAULT_MODEL, resolve_model

    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    if source.kind == "hf_dir":
        return Tokenizer.from_pretrained(source.path)
    # The random-weight test models share SmolLM2's vocabulary (49152 tokens).
    return Tokenizer.from_gguf(resolve_model(DEFAULT_MODEL).path)
