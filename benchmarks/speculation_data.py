"""The training text of bench_speculation.py's model: documents that copy, shaped like the benchmark's workloads.

A model learns to continue a copy only from text that copies, and a small one learns it in minutes only when much
of its text does. Eight kinds of document, separated by blank lines, in a shuffled order:
- edits: a passage of the corpus, an instruction line, the passage again with a few words swapped (the editing
  workload's form, with other words and other wording, so its prompts are not in the training text);
- small copies: a long copy over SMALL_ALPHABET symbols picked for the document, where one symbol matches too many
  places and the model must match on several before it (as English, below, needs);
- repeats: a passage of the corpus written twice (the plainest copying of English, where one byte of context
  matches too many places); long repeats are the same with passages as long as the editing workload's, so the
  second copy reads from 150-320 bytes back;
- code: a small Python class whose methods repeat one shape with other names and operators (the code workload's
  form, with other names);
- copies: watch_it_learn's random strings written twice (the plainest copying signal);
- long copies: one random string of 64-240 characters written twice, a copy from as far back as the editing
  workload's (an induction head grown at a 64-byte context copies from at most about 64 bytes back until these
  teach it further);
- speeches: the corpus as it is, so that text which does not copy stays language.
The corpus's last HELD_OUT characters are never used: the editing workload's passages come from there.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

HELD_OUT = 8 * 300  # bench_speculation's editing passages: its 8 prompts of EDIT_PASSAGE_CHARS characters
PASSAGE = (80, 320)  # an edit's passage, in characters
LONG_SPAN = (64, 240)  # a long copy's string, in characters: both copies fit the 512-byte context
SMALL_ALPHABET = 8  # a small copy's symbols: a 240-character string holds each about 30 times
REPEAT = (80, 240)  # a repeat's passage, in characters: both copies fit the 512-byte context
LONG_REPEAT = (150, 320)  # a long repeat's: the editing workload's 300 (a window holds the start of its copy)
SWAPS = [  # word pairs an edit may swap; never the editing workload's ("the" as "that", "and" as "&")
    ("my", "our"),
    ("you", "thee"),
    ("is", "was"),
    ("not", "never"),
    ("of", "from"),
    ("to", "unto"),
    ("I", "we"),
    ("a", "one"),
    ("with", "by"),
    ("in", "within"),
    ("your", "thy"),
    ("me", "us"),
]
ASKS = [  # how an edit's instruction line is worded
    "Rewrite the text with {swaps}.",
    "Repeat the passage, writing {swaps}.",
    "Give the text again with {swaps}.",
    "Copy this out with {swaps}.",
]
CLASSES = ["Vec", "Pair", "Size", "Range", "Money", "Color", "Box", "Span", "Grid", "Cell", "Frac", "Temp"]
FIELDS = ["a", "b", "w", "h", "lo", "hi", "re", "im", "left", "right", "top", "red", "green", "blue", "n", "d"]
METHODS = [("plus", "+"), ("minus", "-"), ("times", "*"), ("over", "/"), ("mod", "%"), ("power", "**")]
METHODS += [("floor", "//"), ("both", "&"), ("either", "|"), ("shift", "<<")]
# Shares of the characters written: the first stage (a short context) is watch_it_learn's data, half copies and half
# speeches; the second (the full context) carries copying to the full context on random strings; the third to English;
# the fourth makes English copying the bulk, from as far back as the editing workload copies.
FIRST_SHARES = {"copies": 0.5, "speech": 0.5}
SHARES = {"edit": 0.3, "code": 0.15, "copies": 0.15, "long": 0.25, "speech": 0.15}
THIRD_SHARES = {"small": 0.3, "repeat": 0.25, "edit": 0.2, "code": 0.1, "speech": 0.15}
FOURTH_SHARES = {  # the keys' order breaks ties between kinds, so it fixes the text (and bench_speculation's model)
    "long repeat": 0.4,
    "repeat": 0.1,
    "edit": 0.25,
    "small": 0.05,
    "long": 0.05,
    "code": 0.05,
    "speech": 0.1,
}


def passage_of(speeches: list[str], bounds: tuple[int, int], rng: random.Random) -> str:
    """Consecutive speeches from a random one, cut to a length within bounds (shorter at the corpus's end)."""
    start = rng.randrange(len(speeches))
    passage, length = [], rng.randint(*bounds)
    for speech in speeches[start:]:
        passage.append(speech)
        if sum(len(part) + 2 for part in passage) >= length:
            break
    return "\n\n".join(passage)[:length]


def repeat_document(speeches: list[str], rng: random.Random, bounds: tuple[int, int] = REPEAT) -> str:
    """A passage of consecutive speeches (its length within bounds), a blank line, and the passage again."""
    text = passage_of(speeches, bounds, rng)
    return f"{text}\n\n{text}"


def edit_document(speeches: list[str], rng: random.Random) -> str:
    """An instruction, a passage of consecutive speeches, a blank line, and the passage with the words swapped."""
    text = passage_of(speeches, PASSAGE, rng)
    swaps = rng.sample(SWAPS, rng.randint(1, 2))
    changed = text
    for old, new in swaps:
        changed = changed.replace(f" {old} ", f" {new} ")
    asked = rng.choice(ASKS).format(swaps=" and ".join(f"'{old}' as '{new}'" for old, new in swaps))
    return f"{asked}\n\n{text}\n\n{changed}"


def long_copy_document(alphabet: list[str], rng: random.Random) -> str:
    """One random string of the corpus's characters, LONG_SPAN long, written twice back to back."""
    span = "".join(rng.choice(alphabet) for _ in range(rng.randint(*LONG_SPAN)))
    return span + span


def small_copy_document(alphabet: list[str], rng: random.Random) -> str:
    """A long copy (long_copy_document) over SMALL_ALPHABET of the corpus's characters."""
    return long_copy_document(rng.sample(alphabet, SMALL_ALPHABET), rng)


def code_document(rng: random.Random) -> str:
    """A class with a constructor over two or three fields and three to six methods of one shape."""
    name, fields = rng.choice(CLASSES), rng.sample(FIELDS, rng.randint(2, 3))
    lines = [f"class {name}:", f"    def __init__(self, {', '.join(fields)}):"]
    lines += [f"        self.{field} = {field}" for field in fields]
    for method, op in rng.sample(METHODS, rng.randint(3, 6)):
        terms = ", ".join(f"self.{field} {op} other.{field}" for field in fields)
        lines += ["", f"    def {method}(self, other):", f"        return {name}({terms})"]
    return "\n".join(lines)


def training_text(corpus: str, chars: int, shares: dict[str, float], seed: int = 0) -> str:
    """About `chars` characters of documents of the kinds in `shares` (at those shares of the characters), from all
    of the corpus but its last HELD_OUT characters."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from watch_it_learn import copy_document

    kept = corpus[:-HELD_OUT]
    speeches = [speech for speech in kept.split("\n\n") if speech.strip()]
    alphabet = sorted(set(kept) - {"\n"})
    rng = random.Random(seed)
    make = {
        "edit": lambda: edit_document(speeches, rng),
        "code": lambda: code_document(rng),
        "copies": lambda: copy_document(alphabet, rng),
        "long": lambda: long_copy_document(alphabet, rng),
        "repeat": lambda: repeat_document(speeches, rng),
        "long repeat": lambda: repeat_document(speeches, rng, LONG_REPEAT),
        "small": lambda: small_copy_document(alphabet, rng),
        "speech": lambda: speeches[rng.randrange(len(speeches))],
    }
    documents, written = [], {kind: 0 for kind in shares}
    while sum(written.values()) < chars:
        # the kind furthest below its share next, so the shares hold in characters, not documents
        kind = min(shares, key=lambda k: written[k] / shares[k])
        documents.append(make[kind]())
        written[kind] += len(documents[-1]) + 2
    rng.shuffle(documents)
    return "\n\n".join(documents)
