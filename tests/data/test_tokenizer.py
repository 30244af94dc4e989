"""Char, byte and BPE tokenizers: vocabularies, exact round trips, errors, save/load and safe cut points."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptkit.errors import GptkitError, InputError
from gptkit.tokenizer import (
    EOT,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    TokenizerNotFound,
    load_tokenizer,
)

SHAKESPEARE = (Path(__file__).parents[2] / "gptkit" / "corpora" / "tinyshakespeare.txt").read_text(encoding="utf-8")
# A mix hypothesis does not reach by chance: multi-byte scripts, emoji, control characters, the special token.
AWKWARD = "héllo wörld\n\n  日本語 🌍🎉 \t\r\n<|endoftext|>x\x00y  'll 's 123 4567\u200b\ufeff"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    # Tiny shakespeare, indented code (merges of newlines with spaces, which unsafe cuts would break) and a little
    # non-ASCII text (merges across multi-byte characters).
    package = Path(__file__).parents[2] / "gptkit" / "tokenizer"
    code = "".join(path.read_text(encoding="utf-8") for path in sorted(package.glob("*.py")))
    return BPETokenizer.train([SHAKESPEARE[:300_000], code, AWKWARD * 20], vocab_size=600)


# ------------------------------------------------------------------ char


def test_char_vocabulary_of_tiny_shakespeare_is_65_sorted_characters() -> None:
    tok = CharTokenizer.train([SHAKESPEARE])
    assert tok.kind == "char" and tok.vocab_size == 65 and tok.eos_id is None and tok.special_tokens == {}
    assert tok.chars == sorted(set(SHAKESPEARE))
    assert tok.encode("\n !") == [0, 1, 2]  # nanoGPT's ids: sorted order, "\n" first
    assert tok.decode(tok.encode(SHAKESPEARE)) == SHAKESPEARE


def test_char_unknown_character_names_it_and_its_position() -> None:
    tok = CharTokenizer.train(["abc "])
    with pytest.raises(InputError, match=r"'é' \(U\+00E9\) at position 5") as info:
        tok.encode("abc aé")
    assert isinstance(info.value, ValueError) and isinstance(info.value, GptkitError)
    with pytest.raises(InputError, match=r"U\+1F30D.* at position 0"):
        tok.encode("🌍")  # above every known code point


def test_char_specials_follow_the_alphabet_and_round_trip() -> None:
    tok = CharTokenizer.train(["ba"], specials=[EOT])
    assert tok.vocab_size == 3 and tok.eos_id == 2 and tok.special_tokens == {EOT: 2}
    assert tok.encode(f"ab{EOT}ba") == [0, 1, 2, 1, 0]
    with pytest.raises(InputError, match="'<'"):
        tok.encode_arrays([f"ab{EOT}"])  # documents are plain text, and '<' is not in this alphabet
    assert tok.decode([0, 2, 1]) == f"a{EOT}b"
    assert tok.token_byte_lengths().tolist() == [1, 1, 0]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="abcxyzé日\n ", max_size=200))
def test_char_round_trips_text_of_its_alphabet(text: str) -> None:
    tok = CharTokenizer(list("abcxyzé日\n "), [EOT])
    assert tok.decode(tok.encode(text)) == text
    assert np.array_equal(tok.encode_arrays([text])[0], tok.encode(text))


# ------------------------------------------------------------------ byte


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trips_every_string(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < 257 for i in ids)


def test_byte_ids_are_utf8_bytes_and_the_eot_is_256() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_id == 256 and tok.special_tokens == {EOT: 256}
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    assert tok.encode(f"a{EOT}b") == [97, 256, 98]
    assert tok.decode(tok.encode(AWKWARD)) == AWKWARD
    assert tok.encode_arrays([f"a{EOT}"])[0].tolist() == list(f"a{EOT}".encode())  # documents: plain text
    assert tok.decode([0xC3]) == "\ufffd"  # a prefix of a multi-byte character
    assert int(tok.token_byte_lengths()[tok.encode(AWKWARD)].sum()) == len(AWKWARD.encode()) - len(EOT)


def test_byte_rejects_a_lone_surrogate_with_its_position() -> None:
    with pytest.raises(InputError, match=r"U\+D800 at position 2"):
        ByteTokenizer().encode("ab\ud800")


@pytest.mark.parametrize("tok", [ByteTokenizer(), CharTokenizer(list("ab"))], ids=["byte", "char"])
def test_decode_rejects_ids_outside_the_vocabulary(tok) -> None:
    with pytest.raises(InputError, match="token id 999 at position 1"):
        tok.decode([0, 999])


# ------------------------------------------------------------------ bpe


def test_bpe_trains_to_the_requested_size_with_the_eot_special(bpe: BPETokenizer) -> None:
    assert bpe.kind == "bpe" and bpe.vocab_size == 600
    assert bpe.special_tokens == {EOT: bpe.eos_id}
    assert bpe.encode(EOT) == [bpe.eos_id]
    plain = bpe.encode_arrays([f"a{EOT}b"])[0].tolist()  # a document's literal "<|endoftext|>" stays text
    assert bpe.eos_id not in plain and bpe.decode(plain) == f"a{EOT}b"
    assert bpe.encode(f"a{EOT}b") == [bpe.encode("a")[0], bpe.eos_id, bpe.encode("b")[0]]  # encode() is unchanged
    assert len(bpe.encode(SHAKESPEARE[:5000])) < 0.6 * len(SHAKESPEARE[:5000].encode())  # merges compress


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_bpe_round_trips_every_string(bpe: BPETokenizer, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_round_trips_awkward_text_and_counts_its_bytes(bpe: BPETokenizer) -> None:
    ids = bpe.encode(AWKWARD)
    assert bpe.decode(ids) == AWKWARD
    assert int(bpe.token_byte_lengths()[ids].sum()) == len(AWKWARD.encode()) - len(EOT)


def test_token_bytes_rebuild_the_utf8_of_text_cut_inside_characters(bpe: BPETokenizer) -> None:
    from tokenizers import Tokenizer, decoders, models

    text = AWKWARD.replace(EOT, "")
    # A Llama-style vocabulary: a few characters, and <0xNN> tokens for the bytes of all the others.
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {c: 256 + i for i, c in enumerate("helo wrd")}
    fallback = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    fallback.decoder = decoders.ByteFallback()
    for tok in (ByteTokenizer(), bpe, BPETokenizer(fallback)):
        ids = tok.encode(text)
        assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some tokens hold part of a character
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert ByteTokenizer().token_bytes(256) == EOT.encode()


def test_prompts_get_the_start_token_a_tokenizer_json_adds_as_in_transformers(tmp_path: Path) -> None:
    from tokenizers import processors
    from transformers import AutoTokenizer

    from gptkit.decoding.api import encode_prompt

    llama_like = BPETokenizer.train(["the lazy dog " * 50], vocab_size=280, specials=[EOT, "<s>"])
    bos = llama_like.hf.token_to_id("<s>")
    llama_like.hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    llama_like.hf.save(str(tmp_path / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    for text in ("the lazy dog", "dog", ""):
        assert encode_prompt(loaded, text) == reference(text)["input_ids"] == [bos, *loaded.encode(text)]
    assert loaded.encode_arrays(["the dog"])[0].tolist() == loaded.encode("the dog")  # data gets no <s>
    assert encode_prompt(ByteTokenizer(), "") == [256]  # no start token: an empty prompt starts from the EOT


def test_bpe_rejects_a_vocabulary_too_small_for_bytes_and_specials() -> None:
    with pytest.raises(InputError, match="at least 257"):
        BPETokenizer.train(["abc"], vocab_size=256)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.sampled_from(["\n", "\n\n", "\r\n", " ", "    ", "\t", "a", "return", "'s", "日本", "🌍", "12", ".", EOT]),
        max_size=80,
    )
)
def test_bpe_cut_points_never_change_the_encoding(bpe: BPETokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    cuts = bpe.cut_points(text, 3)
    assert cuts is not None and all(0 < c < len(text) for c in cuts) and cuts == sorted(set(cuts))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = bpe.encode_arrays([text])[0]
    assert np.concatenate([np.zeros(0, np.uint32), *bpe.encode_arrays(pieces)]).tolist() == whole.tolist()
    assert bpe.decode(whole.tolist()) == text


def test_bpe_cut_points_keep_whitespace_runs_before_a_newline_whole() -> None:
    text = "Line one of the text\r\nLine two \u00fc\r\nplain\n" * 300
    # Texts ending in \r\n teach a merge of it: \r\n is one piece at a text's end, two inside one.
    crlf = BPETokenizer.train([text, *["end\r\n"] * 50], vocab_size=300)
    assert len(crlf.encode("a\r\n")) == 2
    cuts = crlf.cut_points(text, 64)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert len(pieces) > 100
    assert np.concatenate(crlf.encode_arrays(pieces)).tolist() == crlf.encode(text)


def test_bpe_batch_encoding_of_cut_shakespeare_equals_whole_encoding(bpe: BPETokenizer) -> None:
    text = SHAKESPEARE[:200_000]
    cuts = bpe.cut_points(text, 4096)
    assert len(cuts) > 30
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert np.concatenate(bpe.encode_arrays(pieces)).tolist() == bpe.encode(text)


# ------------------------------------------------------------------ save / load


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_save_and_load_give_the_same_tokenizer(kind: str, bpe: BPETokenizer, tmp_path: Path) -> None:
    tok = {"char": CharTokenizer.train([SHAKESPEARE], [EOT]), "byte": ByteTokenizer(), "bpe": bpe}[kind]
    tok.save(tmp_path)
    for path in (tmp_path, tmp_path / "gptkit_tokenizer.json"):
        loaded = load_tokenizer(path)
        assert type(loaded) is type(tok) and loaded.kind == kind
        assert (loaded.vocab_size, loaded.eos_id, loaded.special_tokens) == (
            tok.vocab_size,
            tok.eos_id,
            tok.special_tokens,
        )
        assert loaded.encode(SHAKESPEARE[:3000]) == tok.encode(SHAKESPEARE[:3000])
    if kind == "bpe":
        assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_loads_a_plain_hugging_face_tokenizer_json_like_gpt2s(bpe: BPETokenizer, tmp_path: Path) -> None:
    """A directory with only tokenizer.json, eos appended last as in GPT-2 (50256): same ids as transformers'."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator([SHAKESPEARE[:100_000]], trainer)
    hf.add_special_tokens([AddedToken(EOT, special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))

    tok = load_tokenizer(tmp_path)
    assert tok.kind == "bpe" and tok.vocab_size == 401 and tok.eos_id == 400
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = SHAKESPEARE[100_000:104_000] + AWKWARD
    assert tok.encode(text) == reference.encode(text)
    assert tok.decode(tok.encode(text)) == text


def test_eos_of_a_tokenizer_without_endoftext_comes_from_tokenizer_config(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False)
    hf.train_from_iterator(["hello world"], trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).eos_id is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_id == 1


def test_load_errors_are_one_clear_gptkit_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerNotFound, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerNotFound, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "gptkit_tokenizer.json").write_text("{not json")
    with pytest.raises(GptkitError, match="cannot read"):
        load_tokenizer(tmp_path)
    (tmp_path / "gptkit_tokenizer.json").write_text(json.dumps({"format": "gptkit-tokenizer", "kind": "word"}))
    with pytest.raises(GptkitError, match="unknown tokenizer kind 'word'"):
        load_tokenizer(tmp_path)
    (tmp_path / "broken.json").write_text('{"model": 3}')
    with pytest.raises(GptkitError, match="cannot load .*broken.json"):
        load_tokenizer(tmp_path / "broken.json")


def test_saving_another_kind_over_a_directory_replaces_the_old_one(bpe: BPETokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path)
    ByteTokenizer().save(tmp_path)  # tokenizer.json stays behind, but gptkit_tokenizer.json decides
    assert load_tokenizer(tmp_path).kind == "byte"
