"""A run's settings from their sources: dataclass defaults < the YAML file < `--section.key VALUE` flags.

Each key is declared once (train_config's dataclasses, ModelConfig, each training part's own settings in
gptkit/finetune) and turned here into flags, help and checks. This module sits one floor above the method catalogue,
so that the settings themselves (gptkit.train_config) stay plain data that the parts may name in their hints.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from gptkit.config import MODEL_SPECIAL, ModelConfig, ModelSection
from gptkit.errors import ConfigError
from gptkit.finetune.catalogue import METHODS, OBJECTIVES, choices_help, default_settings, part_keys, part_settings
from gptkit.settings import coerce, describe, field_comments
from gptkit.train_config import SECTIONS, FinetuneConfig, OptimConfig, RunConfig, TrainConfig


def new_run_config() -> RunConfig:
    """The defaults of every section, each part's settings included."""
    return RunConfig(finetune=FinetuneConfig(parts=default_settings()))


def section_types(section: str) -> dict[str, Any]:
    """Each key a section accepts and its annotated type (the model section's come from ModelConfig, the finetune
    section's parts' from their own settings)."""
    if section == "model":
        return {**MODEL_SPECIAL, **get_type_hints(ModelConfig)}
    hints = get_type_hints(SECTIONS[section])
    if section == "finetune":
        hints.pop("parts")
        hints["method"] = Literal[tuple(METHODS)]  # the catalogue's names
        hints["objective"] = Literal[tuple(OBJECTIVES)]
        hints.update({key: kind for key, (_, kind) in part_keys().items()})
    return hints


def section_comments(section: str) -> dict[str, str]:
    """Each key's description, from its field's comment (a part's settings' own)."""
    if section == "model":
        return {**field_comments(ModelSection), **field_comments(ModelConfig)}
    described = field_comments(SECTIONS[section])
    if section == "finetune":
        described["method"] += ": " + choices_help(METHODS)
        described["objective"] += ": " + choices_help(OBJECTIVES)
        owners = part_settings()  # a part's key is described as "PART: its comment"
        described.update(
            {
                key: f"{owners[kind].split()[-1]}: {field_comments(kind)[key]}"
                for key, (kind, _) in part_keys().items()
                if key in field_comments(kind)
            }
        )
    return described


def _unknown(key: str, known: typing.Iterable[str]) -> ConfigError:
    """An error for an unknown key, suggesting the nearest known one."""
    close = difflib.get_close_matches(key.split(".")[-1], list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def apply(config: RunConfig, overrides: dict[str, dict[str, Any]], source: str) -> RunConfig:
    """A copy of config with {section: {key: value}} applied, every key and value checked."""
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, fields=dict(config.model.fields)),
        **{name: dataclasses.replace(getattr(config, name)) for name in SECTIONS},
    )
    config.finetune.parts = {kind: dataclasses.replace(settings) for kind, settings in config.finetune.parts.items()}
    names = ", ".join(("model", *SECTIONS))
    if not isinstance(overrides, dict):
        raise ConfigError(f"{source} must be a mapping with sections {names}")
    for section, values in overrides.items():
        if section not in ("model", *SECTIONS):
            raise ConfigError(f"{source}: unknown section {section!r}; sections are {names}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of keys to values")
        known = section_types(section)
        for key, value in values.items():
            if key not in known:
                raise _unknown(f"{section}.{key}", known)
            value = coerce(f"{section}.{key}", value, known[key])
            if section == "model" and key in MODEL_SPECIAL:
                setattr(config.model, key, value)
            elif section == "model":
                config.model.fields[key] = value
            elif section == "finetune":
                config.finetune.set(key, value)
            else:
                setattr(getattr(config, section), key, value)
    return config


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The parsed YAML file; an unreadable or malformed file is a one-line ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML: {getattr(err, 'problem', err)}") from None
    return {} if data is None else data


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One `--section.key VALUE` flag per config key, generated from the dataclasses and ModelConfig, each described
    by its field's comment."""
    defaults = {
        "optim": vars(OptimConfig()),
        "train": vars(TrainConfig()),
        "finetune": new_run_config().finetune.flat(),
    }
    for section in ("model", *SECTIONS):
        group = parser.add_argument_group(f"{section} settings (YAML section {section}:)")
        described = section_comments(section)
        for key, kind in section_types(section).items():
            if section == "model":
                shown = "the preset's or ModelConfig's" if key not in MODEL_SPECIAL else "none"
            else:
                shown = repr(defaults[section][key])
            what = described.get(key, "")
            group.add_argument(
                f"--{section}.{key}",
                dest=f"cfg:{section}.{key}",
                metavar="VALUE",
                default=argparse.SUPPRESS,
                help=f"{what}{'; ' if what else ''}{describe(kind)} (default {shown})",
            )


def flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The generated flags the user gave, as {section: {key: value}}, each value parsed as a YAML scalar."""
    overrides: dict[str, dict[str, Any]] = {}
    for dest, text in vars(args).items():
        if not dest.startswith("cfg:"):
            continue
        section, key = dest[4:].split(".", 1)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        kind = section_types(section).get(key) if section in ("model", *SECTIONS) else None
        wants_text = kind is str or str in get_args(kind)  # a path named 2024 or yes stays a string
        if any(get_origin(k) is list for k in (kind, *get_args(kind))):
            value = value if isinstance(value, list) or value is None else [text]  # one flag value: one item
        elif any(dataclasses.is_dataclass(k) for k in (kind, *get_args(kind))) and isinstance(value, dict):
            pass  # a nested setting given as a YAML mapping: --model.rope_scaling '{rope_type: linear, factor: 4}'
        elif value is not None and (wants_text or not isinstance(value, (bool, int, float))):
            value = text  # keep strings (and anything structured) exactly as typed
        overrides.setdefault(section, {})[key] = value
    return overrides


def from_sources(yaml_path: str | Path | None, flags: dict[str, dict[str, Any]]) -> RunConfig:
    """Defaults, then the YAML file (if any), then the flags."""
    config = new_run_config()
    if yaml_path is not None:
        config = apply(config, load_yaml(yaml_path), str(yaml_path))
    return apply(config, flags, "command line")
