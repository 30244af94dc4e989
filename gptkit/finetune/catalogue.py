"""The methods and objectives a run may name (finetune.method, finetune.objective), their settings, and the data each
trains on.

A new method or objective is one file in gptkit/finetune (the part, with its PartSettings) and one entry here; its
settings become flat keys of the finetune section, with flags, help and checks, from that file alone.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, get_type_hints

from gptkit.data import RunData
from gptkit.data_kinds import DATA_KINDS
from gptkit.errors import ConfigError
from gptkit.finetune.dpo import Preference
from gptkit.finetune.full import Full
from gptkit.finetune.heads import Classification
from gptkit.finetune.kto import Unpaired
from gptkit.finetune.lora import Lora
from gptkit.finetune.objectives import LanguageModeling
from gptkit.finetune.orpo import OddsRatioPreference
from gptkit.finetune.parts import Method, Objective, Setup
from gptkit.finetune.rl import GroupPolicyGradient
from gptkit.settings import PartSettings

if TYPE_CHECKING:
    from gptkit.train_config import RunConfig

logger = logging.getLogger(__name__)

METHODS = {"full": Full, "lora": Lora}
OBJECTIVES = {
    "lm": LanguageModeling,
    "dpo": Preference,
    "classify": Classification,
    "grpo": GroupPolicyGradient,
    "orpo": OddsRatioPreference,
    "kto": Unpaired,
}
SECTION_KEYS = ("method", "objective", "packing")  # the finetune section's own keys (FinetuneConfig's)


def part_settings() -> dict[type[PartSettings], str]:
    """Each part's own settings class (a part with no setting and no rule has none) and the setting that picks the
    part, e.g. 'finetune.method lora'."""
    owners: dict[type[PartSettings], str] = {}
    for key, catalogue in (("method", METHODS), ("objective", OBJECTIVES)):
        for name, part in catalogue.items():
            if part.settings_type is not PartSettings:
                owners.setdefault(part.settings_type, f"finetune.{key} {name}")
    return owners


def default_settings() -> dict[type, PartSettings]:
    """A fresh default of every part's settings."""
    return {kind: kind() for kind in part_settings()}


def part_keys() -> dict[str, tuple[type[PartSettings], Any]]:
    """Each part's key: (its settings class, its type); a key two parts declare is a programming error."""
    keys: dict[str, tuple[type[PartSettings], Any]] = {}
    for kind in part_settings():
        hints = get_type_hints(kind)
        for key in (f.name for f in dataclasses.fields(kind)):
            if key in keys or key in SECTION_KEYS:
                raise TypeError(f"finetune.{key} is declared twice ({kind.__name__} and another part)")
            keys[key] = (kind, hints[key])
    return keys


def choices_help(catalogue: dict[str, Any]) -> str:
    """The names of a catalogue, each with its part's one-line description (its docstring's first line)."""
    return "; ".join(
        f"{name}: {(part.__doc__ or '').strip().splitlines()[0].rstrip('.')}" for name, part in catalogue.items()
    )


def resume_may_change() -> tuple[str, ...]:
    """The finetune keys a resumed run may change (the others shaped the weights it continues)."""
    return tuple(key for kind in part_settings() for key in kind.may_change_on_resume)


def check_parts(run: RunConfig) -> None:
    """The rules of the run's method and objective; a setting of a part the run does not use, changed from its
    default, is warned about (it does nothing: a typo in the method's or objective's name, most likely)."""
    f = run.finetune
    used = {METHODS[f.method].settings_type, OBJECTIVES[f.objective].settings_type}
    for kind, owner in part_settings().items():
        settings = f.of(kind)
        if kind in used:
            check_rules(kind, owner, run)
            continue
        changed = [
            field.name
            for field in dataclasses.fields(kind)
            if getattr(settings, field.name) != getattr(kind(), field.name)
        ]
        if changed:
            logger.warning(
                "finetune.%s %s a setting of %s, which this run does not use (finetune.method %s, "
                "finetune.objective %s): it has no effect",
                ", finetune.".join(changed),
                "is" if len(changed) == 1 else "are",
                owner,
                f.method,
                f.objective,
            )


def check_rules(kind: type[PartSettings], owner: str, run: RunConfig) -> None:
    """A ConfigError naming owner (e.g. 'finetune.method lora') when run breaks a rule its settings class declares."""
    if kind.needs_base is not None and run.model.init_from is None:
        raise ConfigError(f"{owner} {kind.needs_base}: set model.init_from")
    if kind.data_parallel_only and run.train.parallel == "fsdp":
        raise ConfigError(f"{owner} trains under train.parallel ddp; use ddp")


def method_for(config: RunConfig) -> Method:
    """The run's method (finetune.method)."""
    method = METHODS[config.finetune.method]
    return method(config.finetune.of(method.settings_type))


def check_data(config: RunConfig, data: RunData) -> None:
    """A ConfigError unless the data set is one the run's objective trains on, naming the objective that fits."""
    name = config.finetune.objective
    wanted = OBJECTIVES[name].data_kinds
    if data.kind in wanted:
        return
    fits = next((other for other, objective in OBJECTIVES.items() if data.kind in objective.data_kinds), "lm")
    raise ConfigError(
        f"finetune.objective {name} trains on {wanted[-1]} (prepared from "
        f"{DATA_KINDS[wanted[-1]].rows}), but {data.directory} holds {data.kind}: use "
        f"finetune.objective {fits}, or prepare other data"
    )


def objective_for(setup: Setup) -> Objective:
    """The run's objective (finetune.objective), built over its data and model."""
    check_data(setup.config, setup.data)
    return OBJECTIVES[setup.config.finetune.objective](setup)
