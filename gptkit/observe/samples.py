"""Samples during training: a few short completions of fixed prompts at evaluations, written to samples.jsonl.

The prompts are the user's (train.sample_prompts) or the first tokens of a few fixed windows of the run's own
validation split (of its validation examples' prompts, for a supervised set): never a text of ours. Each prompt is
completed greedily and once sampled with the run's seed, from a private generator, so the global RNG that resume
replays is never read, and the same run (or a resumed one) gives the same samples.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.atomic import atomic_write_text
from gptkit.data import Examples
from gptkit.decoding.api import complete, encode_prompt
from gptkit.decoding.sampling import SamplingParams
from gptkit.errors import ConfigError, InputError
from gptkit.model import GPT
from gptkit.tokenizer import Tokenizer

SAMPLES_FILE = "samples.jsonl"
DEFAULT_PROMPTS = 2  # validation windows sampled from when train.sample_prompts is not set
PROMPT_TOKENS = 24  # tokens of each default prompt (at most half the block)
LINE_SEARCH = 256  # tokens a default prompt may move forward to start after a line break or end-of-text
SAMPLE_TEMPERATURE = 1.0  # the sampled completion draws from the model's own distribution
SHOWN_CHARS = 100  # characters of a completion shown above the progress bar


@dataclass(frozen=True)
class Sample:
    """One completion: the step of the weights, the prompt, the generated text, and greedy or sampled."""

    step: int
    prompt: str
    completion: str
    kind: str  # "greedy" or "sampled"


def configured_prompts(texts: list[str], tokenizer: Tokenizer, block_size: int) -> list[list[int]]:
    """The ids of train.sample_prompts; an empty or too long prompt is a one-line ConfigError."""
    prompts = []
    for i, text in enumerate(texts):
        try:
            ids = encode_prompt(tokenizer, text)
        except InputError as err:
            raise ConfigError(f"train.sample_prompts[{i}]: {err}") from None
        if len(ids) >= block_size:
            raise ConfigError(
                f"train.sample_prompts[{i}] is {len(ids)} tokens; it must be shorter than the "
                f"model's block_size {block_size}"
            )
        prompts.append(ids)
    return prompts


def _line_start(tokens: np.ndarray, start: int, tokenizer: Tokenizer) -> int:
    """The first position at or after start that follows an end-of-text token or a line break (else start)."""

    def breaks(pos: int) -> bool:
        token = int(tokens[pos])
        return token in tokenizer.eos_ids or tokenizer.decode([token]).endswith("\n")

    stop = min(start + LINE_SEARCH, len(tokens) - 1)
    for pos in range(start, stop):
        if breaks(pos):
            while pos + 1 < stop and breaks(pos + 1):  # past blank lines: the prompt starts with text
                pos += 1
            return pos + 1
    return start


def validation_prompts(
    tokens: np.ndarray, tokenizer: Tokenizer, block_size: int, count: int = DEFAULT_PROMPTS
) -> list[list[int]]:
    """The first tokens of `count` fixed, evenly spaced windows of the validation split, each moved forward to
    start a line (or a document) where one starts close by."""
    length = min(PROMPT_TOKENS, block_size // 2)
    if length < 1 or len(tokens) < length + 1:
        return []
    prompts = []
    for i in range(count):
        start = _line_start(tokens, i * (len(tokens) - length) // count, tokenizer)
        start = min(start, len(tokens) - length)
        prompts.append([int(t) for t in tokens[start : start + length]])
    return prompts


def example_prompts(examples: Examples, block_size: int, count: int = DEFAULT_PROMPTS) -> list[list[int]]:
    """The prompts (the tokens before the first trained one) of the first `count` supervised validation examples
    that have one shorter than the block."""
    prompts = []
    for i in range(len(examples)):
        start, stop = int(examples.offsets[i]), int(examples.offsets[i + 1])
        trained = np.flatnonzero(examples.trained[start:stop])
        if len(trained) and 0 < trained[0] < block_size:
            prompts.append([int(t) for t in examples.ids[start : start + trained[0]]])
        if len(prompts) == count:
            break
    return prompts


def take_samples(
    model: GPT, tokenizer: Tokenizer, prompts: list[list[int]], tokens: int, seed: int, step: int
) -> list[Sample]:
    """A greedy and a sampled completion (seeded: the same weights give the same text) of each prompt."""
    samples = []
    for kind, temperature in (("greedy", 0.0), ("sampled", SAMPLE_TEMPERATURE)):
        params = SamplingParams(max_new_tokens=tokens, temperature=temperature, seed=seed)
        result = complete(model, prompts, params, tokenizer.eos_ids, tokenizer.decode)
        for prompt, row in zip(prompts, result.completions):
            samples.append(Sample(step, tokenizer.decode(prompt), tokenizer.decode(row[0].ids), kind))
    return samples


def append_samples(path: Path, samples: list[Sample]) -> None:
    """Append samples to a samples.jsonl file, one object a line, flushed (a kill loses at most the last line)."""
    with open(path, "a") as file:
        file.write("".join(json.dumps(asdict(s)) + "\n" for s in samples))


def keep_samples(path: Path, up_to: int | None) -> None:
    """Rewrite samples.jsonl with only the lines of steps up to `up_to` (those a resume will not redo); None
    (a new run) empties it."""
    kept = []
    if up_to is not None and path.is_file():
        for line in path.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= up_to:
                kept.append(json.dumps(record) + "\n")
    atomic_write_text(path, "".join(kept))


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The samples of a run's samples.jsonl (an unreadable line is skipped)."""
    records = []
    for line in Path(path).read_bytes().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def note_line(sample: Sample) -> str:
    """A sample as one line above the progress bar: the prompt's end, then the completion, newlines shown as ⏎."""
    text = (sample.prompt[-30:] + "|" + sample.completion)[:SHOWN_CHARS].replace("\n", "⏎")
    return f"  {sample.kind:7s} {text}"
