"""`gptkit prepare`: files of text, supervised examples or prompts in; a data directory (train and val splits, the
tokenizer, meta.json) out.

build.py drives it (inputs, staging, the atomic swap); options.py holds the options; inputs.py streams the
documents of every input format; encoding.py turns text into tokens; text.py, examples.py and prompts.py each write
one kind of data set, with rows.py turning a supervised or prompt row into ids and masks; meta.py writes meta.json.
"""

from gptkit.prepare.build import prepare
from gptkit.prepare.options import DEFAULT_CORPUS, PrepareConfig

__all__ = ["DEFAULT_CORPUS", "PrepareConfig", "prepare"]
