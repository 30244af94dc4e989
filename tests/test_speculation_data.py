"""bench_speculation's training text: each kind of document copies as the workloads do, the shares hold, and the
editing workload's passages (the corpus's end) are never in it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import random  # noqa: E402

import speculation_data as data  # noqa: E402

from gptkit.prepare import DEFAULT_CORPUS  # noqa: E402

CORPUS = DEFAULT_CORPUS.read_text()


def test_an_edit_gives_the_passage_again_with_only_the_asked_swaps():
    document = data.edit_document(CORPUS.split("\n\n"), random.Random(3))
    asked, rest = document.split("\n\n", 1)
    swaps = [part.split("' as '") for part in asked[asked.index("'") + 1 : asked.rindex("'")].split("' and '")]
    # a swap changes the length, so the passage ends at one of the rest's blank lines: the one whose edit follows
    splits = [rest[:i] for i in range(len(rest)) if rest[i : i + 2] == "\n\n"]
    assert any(edit_of(text, rest[len(text) + 2 :], swaps) for text in splits), document


def edit_of(text: str, changed: str, swaps: list[list[str]]) -> bool:
    """Whether changed is text with the swaps made."""
    for old, new in swaps:
        text = text.replace(f" {old} ", f" {new} ")
    return text == changed


def test_code_repeats_one_method_shape():
    document = data.code_document(random.Random(0))
    returns = [line for line in document.splitlines() if line.strip().startswith("return ")]
    assert len(returns) >= 3
    assert len({line.split("(")[0] for line in returns}) == 1  # the same class built each time


def test_the_text_keeps_the_shares_and_never_the_held_out_end():
    text = data.training_text(CORPUS, 200_000, data.SHARES, seed=1)
    assert 200_000 <= len(text) < 210_000
    tail = CORPUS[-data.HELD_OUT :]
    # no line of the held-out end that is long enough to be its own (short lines also occur earlier in the play)
    own = [line for line in tail.splitlines() if len(line) > 40 and line not in CORPUS[: -data.HELD_OUT]]
    assert own and not any(line in text for line in own)
    asks = sum(text.count(ask.split("{")[0]) for ask in data.ASKS)
    assert asks > 100  # edits at 35% of 200k characters, each under ~700


def test_a_long_copy_is_one_string_twice_that_fits_the_context():
    alphabet = sorted(set(CORPUS) - {"\n"})
    document = data.long_copy_document(alphabet, random.Random(2))
    half = len(document) // 2
    assert document[:half] == document[half:]
    assert data.LONG_SPAN[0] <= half <= data.LONG_SPAN[1] and len(document) <= 512  # bench_speculation's context


def test_a_repeat_is_a_passage_of_the_corpus_twice():
    document = data.repeat_document(CORPUS[: -data.HELD_OUT].split("\n\n"), random.Random(5))
    half = (len(document) - 2) // 2
    assert document[:half] == document[half + 2 :] and document[half : half + 2] == "\n\n"
    assert document[:half] in CORPUS and half <= data.REPEAT[1]


def test_a_small_copy_uses_few_symbols():
    document = data.small_copy_document(sorted(set(CORPUS) - {"\n"}), random.Random(6))
    assert len(set(document)) <= data.SMALL_ALPHABET
    assert document[: len(document) // 2] == document[len(document) // 2 :]


def test_a_long_repeat_copies_from_as_far_back_as_the_editing_workload():
    speeches = CORPUS[: -data.HELD_OUT].split("\n\n")
    halves = []
    for seed in range(20):
        document = data.repeat_document(speeches, random.Random(seed), data.LONG_REPEAT)
        half = (len(document) - 2) // 2
        assert document[:half] == document[half + 2 :] and half <= data.LONG_REPEAT[1]
        halves.append(half)
    assert max(halves) >= 300  # the editing workload's passages are 300 characters


def test_every_stage_names_kinds_the_text_makes():
    for shares in (data.FIRST_SHARES, data.SHARES, data.THIRD_SHARES, data.FOURTH_SHARES):
        assert abs(sum(shares.values()) - 1) < 1e-9
        assert data.training_text(CORPUS, 5_000, shares)
