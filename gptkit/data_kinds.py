"""The kinds of prepared data set (meta.json "kind") and the JSON row formats they are made from, each described
once: what `gptkit prepare` recognises a row by, and how a run reads the data set. prepare.py, data.py,
prepare/rows.py and the objectives ask these tables rather than name a kind, so a new kind is an entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataKind:
    """One kind of data set."""

    name: str
    rows: str  # what `gptkit prepare` makes it from, as an error message names it
    noun: str  # what its items are called, plural ("preference pairs")
    examples: bool = True  # stored as examples (ids, trained mask, offsets); else a token stream or prompts
    items_of: int = 1  # examples per item a batch draws and keeps together (a preference pair: chosen, rejected)
    per_token: bool = False  # a loss over it is a mean over trained tokens, not over items
    whole_input: bool = False  # every token is an input (a labelled text is read at its last token)
    labels: bool = False  # each example has a label: an index into meta.json's "labels"
    label_names: tuple[str, ...] | None = None  # a fixed set of labels, in index order (else the data's, sorted)
    min_labels: int = 0  # distinct labels a data set of the kind needs
    packable: bool = False  # several examples may share a row (finetune.packing)


@dataclass(frozen=True)
class RowFormat:
    """A JSON row format: the keys that tell it (formats are tried in order), the kind of data set its rows make,
    how its example is encoded, and where its label is."""

    name: str
    keys: tuple[str, ...]  # a row with every one of these keys is of this format
    kind: str
    title: str  # what `gptkit prepare`'s summary calls its rows
    hint: str  # its keys, as an error message names them
    encoded_as: str | None = None  # another format whose encoding it shares (None: its own)
    label: str | None = None  # the key of the row's label


TEXT = DataKind("text", "text", "tokens", examples=False)
PROMPTS = DataKind("prompts", '{"prompt"} rows or messages ending with a user turn', "prompts", examples=False)
DATA_KINDS = {
    kind.name: kind
    for kind in (
        TEXT,
        DataKind("examples", "text or supervised rows", "examples", per_token=True, packable=True),
        DataKind("preferences", '{"prompt", "chosen", "rejected"} rows', "preference pairs", items_of=2),
        DataKind("labelled", '{"text", "label"} rows', "labelled texts", whole_input=True, labels=True, min_labels=2),
        DataKind(
            "unpaired",
            '{"prompt", "completion", "label": true|false} rows',
            "marked completions",
            labels=True,
            label_names=("false", "true"),
        ),
        PROMPTS,
    )
}
EXAMPLE_KINDS = tuple(name for name, kind in DATA_KINDS.items() if kind.examples)

# Tried in this order: the first format whose keys a row has is its format (a prompt row, which has no answer, is
# told apart by finetune.examples.is_prompt_row).
ROW_FORMATS = {
    fmt.name: fmt
    for fmt in (
        RowFormat(
            "preference",
            ("chosen", "rejected"),
            "preferences",
            "prompt/chosen/rejected",
            '"chosen" and "rejected" (and "prompt")',
        ),
        RowFormat("messages", ("messages",), "examples", "conversation", 'a "messages" list'),
        RowFormat(
            "unpaired",
            ("prompt", "completion", "label"),
            "unpaired",
            "prompt/completion/label",
            '"prompt", "completion" and "label" (true or false)',
            encoded_as="prompt_completion",
            label="label",
        ),
        RowFormat(
            "prompt_completion", ("prompt", "completion"), "examples", "prompt/completion", '"prompt" and "completion"'
        ),
        RowFormat("alpaca", ("instruction", "output"), "examples", "Alpaca", '"instruction" and "output"'),
        RowFormat("labelled", ("text", "label"), "labelled", "text/label", '"text" and "label"', label="label"),
        RowFormat("text", ("text",), "examples", "text", 'a "text" string'),
    )
}
PROMPT_FORMAT = RowFormat(
    "prompt",
    ("prompt",),
    "prompts",
    "prompt",
    '"prompt" as a string, or "prompt" or "messages" ending with a user turn; no "completion", "chosen" or "rejected"',
)
SUPERVISED = tuple(name for name in (*ROW_FORMATS, PROMPT_FORMAT.name) if name != "text")  # not text rows alone


def format_of(record: object) -> str | None:
    """The format a JSON row's keys say it is in, or None."""
    if not isinstance(record, dict):
        return None
    return next((fmt.name for fmt in ROW_FORMATS.values() if all(key in record for key in fmt.keys)), None)


def row_format(name: str) -> RowFormat:
    """The row format of a name (the prompt format included)."""
    return PROMPT_FORMAT if name == PROMPT_FORMAT.name else ROW_FORMATS[name]
