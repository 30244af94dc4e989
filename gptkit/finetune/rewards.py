"""Reward functions for reinforcement learning from verifiable rewards: a completion of a prompt -> a number.

A reward is named by a spec (load_reward):
    exact_match         1.0 when the completion's final answer (after its last "####", GSM8K's mark, else all of
                        it) equals the row's "answer"; numbers compare as numbers ("1,000" == "1000", "46.0" == "46")
    regex:PATTERN       1.0 when PATTERN (Python's re) is found in the completion
    json_schema         1.0 when the completion is JSON valid against the row's "schema" (needs jsonschema)
    module:function     function(prompt, completion, row) -> a number, from module.py of the working directory

Every reward is called as reward(prompt, completion, row): the prompt as the model saw it, the text it wrote, and
the prompt's input row (gptkit.data.Prompts), and returns a plain float.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import numbers
import os
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

from gptkit.decoding.grammar import SchemaError, schema_text
from gptkit.errors import ConfigError, GptkitError

ANSWER_MARK = "####"  # GSM8K's solutions end with "#### <answer>"
BUILT_IN = ("exact_match", "regex:PATTERN", "json_schema")
# A number as answers write it: digits with optional thousands commas, an optional sign and decimal part.
NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d*)?")
_MISSING = object()


class RewardError(GptkitError):
    """A user's reward function failed or returned something that is not a finite number."""


class Reward:
    """A reward function named by its spec: reward(prompt, completion, row) -> float."""

    needs: tuple[str, ...] = ()  # the row fields every prompt must have

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float:
        """The completion's reward."""
        raise NotImplementedError

    def check_rows(self, rows: list[dict[str, Any]]) -> None:
        """A ConfigError naming the first row (by index) that lacks what this reward needs."""
        for i, row in enumerate(rows):
            for field in self.needs:
                if field not in row:
                    raise ConfigError(f"reward {self.name} needs a {field!r} field in every prompt row; prompt {i} has "
                                      f"none (its fields: {', '.join(map(repr, list(row)[:10])) or 'none'}); add it "
                                      "and prepare the prompts again")  # fmt: skip
            problem = self._row_problem(row)
            if problem:
                raise ConfigError(f"reward {self.name}: prompt {i}'s {problem}")

    def _row_problem(self, row: dict[str, Any]) -> str | None:
        """What is wrong with a row that has the needed fields, or None."""
        return None

    def __repr__(self) -> str:
        return f"Reward({self.name!r})"


def final_answer(completion: str) -> str:
    """The answer a completion ends with: the text after its last "####" if it has one, else all of it; stripped."""
    return completion.rpartition(ANSWER_MARK)[2].strip()


def _normal(answer: str) -> str | Decimal:
    """An answer as it is compared: a number as its value (without thousands commas), other text as it is."""
    answer = answer.strip()
    return Decimal(answer.replace(",", "")) if NUMBER.fullmatch(answer) else answer


class ExactMatch(Reward):
    """1.0 when the completion's final answer equals the row's "answer" (numbers compared as numbers), else 0.0."""

    needs = ("answer",)

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float:
        return float(_normal(final_answer(completion)) == _normal(str(row["answer"])))

    def _row_problem(self, row: dict[str, Any]) -> str | None:
        answer = row["answer"]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            return f"\"answer\" must be a string or a number, got {type(answer).__name__}"
        return None


class Regex(Reward):
    """1.0 when the pattern is found in the completion (re.search), else 0.0."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        try:
            self.pattern = re.compile(name.removeprefix("regex:"))
        except re.error as err:
            raise ConfigError(f"reward {name}: the pattern is not a valid regular expression ({err}); write a "
                              "Python re pattern after regex:") from None  # fmt: skip

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float:
        return float(self.pattern.search(completion) is not None)


class JsonSchema(Reward):
    """1.0 when the completion is JSON valid against the row's "schema" (an object, or its JSON text), else 0.0."""

    needs = ("schema",)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        try:
            import jsonschema  # an optional package: only this reward needs it
        except ImportError:
            raise ConfigError(f"reward {name} validates with the jsonschema package: pip install jsonschema") from None
        self.jsonschema = jsonschema

    def _validator(self, schema: Any) -> Any:
        """The validator of a row's schema; SchemaError (or jsonschema's) if it is not a valid schema."""
        return _schema_validator(schema_text(schema))

    def _row_problem(self, row: dict[str, Any]) -> str | None:
        try:
            self._validator(row["schema"])
        except (SchemaError, self.jsonschema.SchemaError) as err:
            return f"\"schema\" is not a valid JSON schema: {_schema_problem(err)}"
        return None

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float:
        try:
            validator = self._validator(row["schema"])
        except (SchemaError, self.jsonschema.SchemaError) as err:
            raise RewardError(f"reward {self.name}: the row's \"schema\" is not a valid JSON schema "
                              f"({_schema_problem(err)})") from None  # fmt: skip
        try:
            return float(validator.is_valid(json.loads(completion)))
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser or validator can follow
            return 0.0
        except Exception as err:  # the schema's fault, not the completion's (a "$ref" it cannot resolve, say)
            raise RewardError(f"reward {self.name}: validating against the row's \"schema\" failed: "
                              f"{type(err).__name__}: {_one_line(str(err))}") from None  # fmt: skip


@functools.lru_cache(maxsize=256)  # a prompt's schema is checked once, not at each of its completions
def _schema_validator(text: str) -> Any:
    """The jsonschema validator of a schema's JSON text, checked against its meta-schema."""
    import jsonschema  # only json_schema calls this, once it found the package

    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


class UserFunction(Reward):
    """A function(prompt, completion, row) -> number from a module of the working directory, its result checked."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        module, _, attribute = name.partition(":")
        if not all(part.isidentifier() for part in module.split(".")) or not attribute.isidentifier():
            raise ConfigError(f"reward {name!r} is not module:function (a Python module name, a colon, a function "
                              "name)")  # fmt: skip
        self.function = getattr(_import(module, name), attribute, _MISSING)
        if self.function is _MISSING:
            raise ConfigError(f"reward {name}: module {module} has no {attribute!r}; define "
                              f"def {attribute}(prompt, completion, row) in it")  # fmt: skip
        if not callable(self.function):
            raise ConfigError(f"reward {name}: {module}.{attribute} is a {type(self.function).__name__}, not a "
                              "function")  # fmt: skip

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float:
        try:
            value = self.function(prompt, completion, row)
        except Exception as err:  # the user's code: any failure is reported as theirs, in one line
            raise RewardError(f"reward function {self.name} raised {type(err).__name__}: "
                              f"{_one_line(str(err))}") from err  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"reward function {self.name} returned {_shown(value)} ({type(value).__name__}), not a "
                              "number; return an int or a float")  # fmt: skip
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            number = math.inf
        if not math.isfinite(number):
            raise RewardError(f"reward function {self.name} returned {_shown(value)}, not a finite number")
        return number


def _import(module: str, spec: str) -> Any:
    """module imported as `python -m` finds it: the working directory first on sys.path, and left there (the
    function may import its own helpers when it is called)."""
    here = os.getcwd()
    if not sys.path or sys.path[0] not in ("", here):
        sys.path.insert(0, here)
    importlib.invalidate_caches()  # a module written since the last import looked at the directory
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name) and module[len(err.name) :][:1] in ("", "."):
            raise ConfigError(f"reward {spec}: no module {module!r} in the working directory ({here}) or on "
                              f"the Python path; put {module.replace('.', '/')}.py there") from None  # fmt: skip
        raise ConfigError(f"reward {spec}: importing {module} failed: {_one_line(str(err))}") from None
    except Exception as err:  # the module's own code failed while it was imported
        raise ConfigError(f"reward {spec}: importing {module} raised {type(err).__name__}: "
                          f"{_one_line(str(err))}") from None  # fmt: skip
    own = Path(here, *module.split("."))
    found = Path(getattr(imported, "__file__", None) or "")
    if (own.with_suffix(".py").is_file() or own.is_dir()) and not found.is_relative_to(here):
        # A name Python had already imported (the standard library's string, a package's) hides the user's file.
        raise ConfigError(f"reward {spec}: {module} is already the module at {found}, not {own}.py; rename your "
                          "file (and the spec) to a name Python does not already use")  # fmt: skip
    return imported


def _schema_problem(err: Exception) -> str:
    """What is wrong with a schema, in one line (jsonschema's message, without the schema it prints after it)."""
    return _one_line(getattr(err, "message", None) or str(err))


def _one_line(text: str) -> str:
    """text on one line (an exception message may span several)."""
    return " ".join(text.split()) or "(no message)"


def _shown(value: Any) -> str:
    """A value's repr, cut to a length an error line can hold."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_reward(spec: str) -> Reward:
    """The reward a spec names: exact_match, regex:PATTERN, json_schema or module:function; ConfigError otherwise."""
    if not isinstance(spec, str):
        raise ConfigError(f"a reward is named by a string, got {type(spec).__name__}")
    if spec == "exact_match":
        return ExactMatch(spec)
    if spec == "json_schema":
        return JsonSchema(spec)
    if spec.startswith("regex:"):
        return Regex(spec)
    if ":" in spec:
        return UserFunction(spec)
    raise ConfigError(f"unknown reward {spec!r}: use {', '.join(BUILT_IN)} or module:function (a function(prompt, "
                      "completion, row) -> float in module.py of the working directory)")  # fmt: skip
