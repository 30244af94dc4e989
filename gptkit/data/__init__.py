"""Reading a prepared data directory (written by `gptkit prepare`, see gptkit.prepare): meta.json (meta.py), token
files and their training windows (tokens.py), example and prompt sets (examples.py, prompts.py), the micro-batch
every objective reads (batch.py), and a run's data with its batches moved to the device (run.py).

A data directory holds train.bin and val.bin (flat arrays of token ids, uint16 or uint32, or per-example files
for example and prompt sets), the tokenizer's files, and meta.json, written last: a directory without meta.json
is incomplete.
"""

from gptkit.data.batch import TENSOR_FIELDS, Batch
from gptkit.data.examples import PAD_MULTIPLE, ExampleBatches, Examples, example_batches, example_rows, load_examples
from gptkit.data.meta import (
    EXAMPLE_FILES,
    META_FILE,
    PROMPT_FILES,
    PROMPT_KIND,
    SPLIT_FILES,
    TOKEN_DTYPES,
    DataMeta,
    data_kind,
    is_examples,
    read_meta,
)
from gptkit.data.prompts import Prompts, load_prompts
from gptkit.data.run import Batches, RunData, load_run_data
from gptkit.data.tokens import TrainBatches, load_tokens, sequential_batches
from gptkit.data_kinds import EXAMPLE_KINDS

__all__ = [
    "EXAMPLE_FILES",
    "EXAMPLE_KINDS",
    "META_FILE",
    "PAD_MULTIPLE",
    "PROMPT_FILES",
    "PROMPT_KIND",
    "SPLIT_FILES",
    "TENSOR_FIELDS",
    "TOKEN_DTYPES",
    "Batch",
    "Batches",
    "DataMeta",
    "ExampleBatches",
    "Examples",
    "Prompts",
    "RunData",
    "TrainBatches",
    "data_kind",
    "example_batches",
    "example_rows",
    "is_examples",
    "load_examples",
    "load_prompts",
    "load_run_data",
    "load_tokens",
    "read_meta",
    "sequential_batches",
]
