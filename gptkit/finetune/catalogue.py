"""The methods and objectives a run may name (finetune.method, finetune.objective), and the data each trains on.

A new method or objective is one file in gptkit/finetune and one entry here.
"""

from __future__ import annotations

from gptkit.data import RunData
from gptkit.errors import ConfigError
from gptkit.finetune.dpo import Preference
from gptkit.finetune.full import Full
from gptkit.finetune.heads import Classification
from gptkit.finetune.lora import Lora
from gptkit.finetune.objectives import LanguageModeling
from gptkit.finetune.parts import Method, Objective, Setup
from gptkit.finetune.rl import GroupPolicyGradient
from gptkit.train_config import RunConfig

METHODS = {"full": Full, "lora": Lora}
OBJECTIVES = {"lm": LanguageModeling, "dpo": Preference, "classify": Classification, "grpo": GroupPolicyGradient}
# What `gptkit prepare` makes each kind of data set from, for the error that names the objective that fits.
DATA_ROWS = {"text": "text", "examples": "text or supervised rows", "preferences": '{"prompt", "chosen", "rejected"} '
             'rows', "labelled": '{"text", "label"} rows', "prompts": '{"prompt"} rows or messages ending with a user '
             "turn"}  # fmt: skip


def method_for(config: RunConfig) -> Method:
    """The run's method (finetune.method)."""
    return METHODS[config.finetune.method]()


def check_data(config: RunConfig, data: RunData) -> None:
    """A ConfigError unless the data set is one the run's objective trains on, naming the objective that fits."""
    name = config.finetune.objective
    wanted = OBJECTIVES[name].data_kinds
    if data.kind in wanted:
        return
    fits = next((other for other, objective in OBJECTIVES.items() if data.kind in objective.data_kinds), "lm")
    raise ConfigError(f"finetune.objective {name} trains on {wanted[-1]} (prepared from {DATA_ROWS[wanted[-1]]}), "
                      f"but {data.directory} holds {data.kind}: use finetune.objective {fits}, or prepare other "
                      "data")  # fmt: skip


def objective_for(setup: Setup) -> Objective:
    """The run's objective (finetune.objective), built over its data and model."""
    check_data(setup.config, setup.data)
    return OBJECTIVES[setup.config.finetune.objective](setup)
