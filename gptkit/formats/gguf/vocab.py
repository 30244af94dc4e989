"""A tokenizer as llama.cpp's byte-level BPE vocabulary in a GGUF file (tokenizer.ggml.*), and back: part of the GGUF
format (gptkit.formats.gguf writes and reads the rest of the file).

gptkit's byte tokenizer goes in as the 256 byte symbols and no merges, a character tokenizer whose characters are all
single bytes the same way (with an end-of-text token added when it has no special token: llama.cpp takes token 11
as end of text when a file names none, and a character model's token 11 is a character), and a byte-level BPE whose
pre-tokenizer llama.cpp knows by name. Reading gives the byte tokenizer back when the file holds exactly its layout,
a char tokenizer for single-byte symbols without merges, else a byte-level BPE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from gptkit.errors import GptkitError
from gptkit.tokenizer import BYTE_LEVEL_SYMBOLS, EOT, BPETokenizer, ByteTokenizer, CharTokenizer, Tokenizer

# The regex of a byte-level pre-tokenizer, by the name llama.cpp's vocabulary loader knows it as
# (llama.cpp src/llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2 and _LLAMA3).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {"gpt-2": GPT2_REGEX, "llama-bpe": LLAMA3_REGEX}
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama.cpp's token types


class GGUFError(GptkitError):
    """A model that GGUF (as llama.cpp computes it) cannot hold, or a GGUF file gptkit cannot read."""


class Vocabulary(NamedTuple):
    """A tokenizer as llama.cpp's byte-level BPE: its tokens, their types, the merges, the pre-tokenizer's name and
    the end-of-text id; added counts the tokens the file adds to the tokenizer's own (an end-of-text token)."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    eos_id: int | None
    added: int = 0


def tokenizer_vocab(tokenizer: Tokenizer) -> Vocabulary:
    """The tokenizer as llama.cpp's byte-level BPE, or a GGUFError saying why it cannot be one."""
    if isinstance(tokenizer, ByteTokenizer):
        specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
        tokens = [BYTE_LEVEL_SYMBOLS[b] for b in range(256)] + [s for s, _ in specials]
        return Vocabulary(tokens, [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL] * len(specials), [], "gpt-2", tokenizer.eos_id)
    if isinstance(tokenizer, CharTokenizer):
        return _char_vocab(tokenizer)
    if isinstance(tokenizer, BPETokenizer):
        return _bpe_vocab(tokenizer)
    raise GGUFError(f"a {tokenizer.kind} tokenizer cannot be written as GGUF")


def _char_vocab(tokenizer: CharTokenizer) -> Vocabulary:
    """A char tokenizer's characters as byte symbols; without special tokens, an end-of-text token is added (see
    the module's docstring)."""
    wide = [c for c in tokenizer.chars if len(c.encode("utf-8")) != 1]
    if wide:
        raise GGUFError(
            f"the char tokenizer's character {wide[0]!r} is several UTF-8 bytes: llama.cpp's "
            "byte-level tokenizer cannot give it one id; train a byte or bpe tokenizer instead"
        )
    tokens = [BYTE_LEVEL_SYMBOLS[ord(c)] for c in tokenizer.chars]
    specials = list(tokenizer.special_tokens) or [EOT]
    added = 0 if tokenizer.special_tokens else 1
    eos_id = len(tokens) + specials.index(EOT) if EOT in specials else tokenizer.eos_id
    return Vocabulary(
        tokens + specials, [TOKEN_NORMAL] * len(tokens) + [TOKEN_CONTROL] * len(specials), [], "gpt-2", eos_id, added
    )


def _bpe_vocab(tokenizer: BPETokenizer) -> Vocabulary:
    spec = json.loads(tokenizer.hf.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") is not None:
        raise GGUFError(
            "only a byte-level BPE tokenizer without a normaliser can be written as GGUF (this one: "
            f"{model.get('type')} model, normaliser {bool(spec.get('normalizer'))}); export with "
            "--to-hf and use llama.cpp's converter with the original tokenizer files"
        )
    name = _pre_tokenizer_name(pre)
    size = tokenizer.vocab_size
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    tokens = [""] * size
    for token, i in vocab.items():
        tokens[i] = token
    if any(t == "" for t in tokens):
        raise GGUFError("the tokenizer's ids are not contiguous; GGUF needs one token per id")
    types = [TOKEN_CONTROL if i in tokenizer.special_tokens.values() else TOKEN_NORMAL for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return Vocabulary(tokens, types, merges, name, tokenizer.eos_id)


def _pre_tokenizer_name(pre: dict[str, Any]) -> str:
    """llama.cpp's name for a byte-level pre-tokenizer (tokenizer.json's), or a GGUFError."""
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if (
        len(parts) == 2
        and parts[0].get("type") == "Split"
        and parts[1].get("type") == "ByteLevel"
        and not parts[1].get("use_regex", True)
    ):
        regex = parts[0].get("pattern", {}).get("Regex")
        for name, known in PRE_TOKENIZERS.items():
            if regex == known:
                return name
    raise GGUFError(
        f"llama.cpp knows no pre-tokenizer like this tokenizer's ({json.dumps(pre)[:120]}); export with --to-hf instead"
    )


def inert_merge(tokens: list[str], types: list[int]) -> str:
    """A merge that never applies, for a vocabulary of single symbols: llama.cpp requires at least one merge, and
    one of two special tokens never meets a pair of symbols (specials are split off before BPE runs)."""
    specials = [t for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL]
    if not specials:
        raise GGUFError("a tokenizer without merges needs a special token (such as <|endoftext|>) for GGUF")
    return f"{specials[0]} {specials[0]}"


def tokenizer_from_fields(fields: dict[str, Any], path: Path) -> Tokenizer:
    """The GGUF file's tokenizer: gptkit's byte tokenizer when the file holds exactly its layout, else byte-level BPE."""
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if model != "gpt2" or not tokens:
        raise GGUFError(f'{path} has a {model!r} tokenizer; gptkit reads GGUF\'s byte-level BPE ("gpt2") tokenizers')
    types = fields.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    specials = [t for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL]
    inert = {f"{a} {b}" for a in specials for b in specials}  # see inert_merge
    merges = [m for m in fields.get("tokenizer.ggml.merges") or [] if m not in inert]
    if (
        not merges
        and tokens[:256] == [BYTE_LEVEL_SYMBOLS[b] for b in range(256)]
        and len(specials) == len(tokens) - 256
    ):
        tokenizer: Tokenizer = ByteTokenizer(specials)
        if eos_id is not None and tokenizer.eos_id != eos_id:
            tokenizer.eos_id = int(eos_id)
        return tokenizer
    chars = _char_layout(tokens, types) if not merges else None
    if chars is not None:
        tokenizer = CharTokenizer(chars, specials)
        if eos_id is not None and tokenizer.eos_id != eos_id:
            tokenizer.eos_id = int(eos_id)
        return tokenizer
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    pre = fields.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS and pre != "default":
        raise GGUFError(f"{path}'s pre-tokenizer {pre!r} is not one gptkit knows ({', '.join(PRE_TOKENIZERS)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # What the tokenizers library requires of a merge, checked here: it reports a damaged one as a Rust panic
    broken = next(
        (m for m, pair in zip(merges, pairs) if len(pair) != 2 or not {*pair, "".join(pair)} <= vocab.keys()), None
    )
    if len(vocab) != len(tokens) or broken is not None:
        what = f"merge {broken!r} joins tokens outside the vocabulary" if broken else "the vocabulary repeats a token"
        raise GGUFError(f"{path}: the tokenizer is damaged ({what}); download or convert the file again")
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
    if pre == "llama-bpe":
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True) for t in specials])
    eos = tokens[int(eos_id)] if eos_id is not None else EOT
    return BPETokenizer(hf, eos)


def _char_layout(tokens: list[str], types: list[int]) -> list[str] | None:
    """The characters of a vocabulary written from a char tokenizer (single-byte ASCII symbols, then special
    tokens), or None when it is not one."""
    normal = [t for t, kind in zip(tokens, types) if kind != TOKEN_CONTROL]
    if tokens[: len(normal)] != normal or not normal:
        return None
    byte_of = {symbol: b for b, symbol in BYTE_LEVEL_SYMBOLS.items()}
    codes = [byte_of.get(t) for t in normal]
    if any(code is None or code >= 0x80 for code in codes):
        return None
    return [chr(code) for code in codes]
