"""Reward functions for reinforcement learning from verifiable rewards: a completion of a prompt -> a number.

A reward is named by a spec (load_reward):
    exact_match         1.0 when the completion's final answer (after its last "####", GSM8K's mark, else all of
                        it) equals the row's "answer"; numbers compare as numbers ("1,000" == "1000", "46.0" == "46")
    regex:PATTERN       1.0 when PATTERN (Python's re) is found in the completion
    json_schema         1.0 when the completion is JSON valid against the row's "schema" (needs jsonschema)
    module:function     function(prompt, completion, row) -> a number, from module.py of the working directory

Every reward is called as reward(prompt, completion, row): the prompt as the model saw it, the text it wrote, and
the prompt's input row (gptkit.data.Prompts), and returns a plain float, or None where it does not apply (a
format reward for a task whose rows have no format, say): GRPO leaves it out of that completion's sum.

Training calls a reward through RewardProcess: in a process of its own (gptkit.worker), where a call that hangs
is stopped at its deadline and every way the user's code can end a call is one error line naming the reward.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import numbers
import os
import re
import signal
import sys
import time
import weakref
from decimal import Decimal
from pathlib import Path
from typing import Any

from gptkit.errors import ConfigError, StepAbandoned
from gptkit.worker import (
    PACKAGE_ROOT,
    Interrupted,
    LineWorker,
    child_pipes,
    exit_with_parent,
    send_line,
    signals_end_waits,
)

ANSWER_MARK = "####"  # GSM8K's solutions end with "#### <answer>"
BUILT_IN = ("exact_match", "regex:PATTERN", "json_schema")
# A number as answers write it: digits with optional thousands commas, an optional sign and decimal part.
NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d*)?")
_MISSING = object()
WORKER_COMMAND = (sys.executable, "-c", "from gptkit.finetune.rewards import reward_worker; reward_worker()")
START_S = 60.0  # allowed beyond finetune.reward_timeout for a reward's process to start and import its module


class RewardError(StepAbandoned):
    """A reward function failed, returned something that is not a finite number, or was stopped (its deadline
    passed, or a stop signal came while it ran: interrupted)."""


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
                    raise ConfigError(
                        f"reward {self.name} needs a {field!r} field in every prompt row; prompt {i} has "
                        f"none (its fields: {', '.join(map(repr, list(row)[:10])) or 'none'}); add it "
                        "and prepare the prompts again"
                    )
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
            return f'"answer" must be a string or a number, got {type(answer).__name__}'
        return None


class Regex(Reward):
    """1.0 when the pattern is found in the completion (re.search), else 0.0."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        try:
            self.pattern = re.compile(name.removeprefix("regex:"))
        except re.error as err:
            raise ConfigError(
                f"reward {name}: the pattern is not a valid regular expression ({err}); write a "
                "Python re pattern after regex:"
            ) from None

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
        # Imported here, not with this module: the grammar imports torch, a second of every reward process's start.
        from gptkit.decoding.grammar import SchemaError, schema_text

        self.jsonschema, self.schema_text = jsonschema, schema_text
        self.schema_errors = (SchemaError, jsonschema.SchemaError)

    def _validator(self, schema: Any) -> Any:
        """The validator of a row's schema; SchemaError (or jsonschema's) if it is not a valid schema."""
        return _schema_validator(self.schema_text(schema))

    def _row_problem(self, row: dict[str, Any]) -> str | None:
        try:
            self._validator(row["schema"])
        except self.schema_errors as err:
            return f'"schema" is not a valid JSON schema: {_schema_problem(err)}'
        return None

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float:
        try:
            validator = self._validator(row["schema"])
        except self.schema_errors as err:
            raise RewardError(
                f'reward {self.name}: the row\'s "schema" is not a valid JSON schema ({_schema_problem(err)})'
            ) from None
        try:
            return float(validator.is_valid(json.loads(completion)))
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser or validator can follow
            return 0.0
        except Exception as err:  # the schema's fault, not the completion's (a "$ref" it cannot resolve, say)
            raise RewardError(
                f'reward {self.name}: validating against the row\'s "schema" failed: '
                f"{type(err).__name__}: {_one_line(str(err))}"
            ) from None


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
            raise ConfigError(
                f"reward {name!r} is not module:function (a Python module name, a colon, a function name)"
            )
        self.function = getattr(_import(module, name), attribute, _MISSING)
        if self.function is _MISSING:
            raise ConfigError(
                f"reward {name}: module {module} has no {attribute!r}; define "
                f"def {attribute}(prompt, completion, row) in it"
            )
        if not callable(self.function):
            raise ConfigError(
                f"reward {name}: {module}.{attribute} is a {type(self.function).__name__}, not a function"
            )

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float | None:
        try:
            value = self.function(prompt, completion, row)
        except Exception as err:  # the user's code: any failure is reported as theirs, in one line
            raise RewardError(
                f"reward function {self.name} raised {type(err).__name__}: {_one_line(str(err))}"
            ) from err
        if value is None:  # the reward does not apply to this completion
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward function {self.name} returned {_shown(value)} ({type(value).__name__}), not a "
                "number; return an int or a float (or None where the reward does not apply)"
            )
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
            raise ConfigError(
                f"reward {spec}: no module {module!r} in the working directory ({here}) or on "
                f"the Python path; put {module.replace('.', '/')}.py there"
            ) from None
        raise ConfigError(f"reward {spec}: importing {module} failed: {_one_line(str(err))}") from None
    except Exception as err:  # the module's own code failed while it was imported
        raise ConfigError(
            f"reward {spec}: importing {module} raised {type(err).__name__}: {_one_line(str(err))}"
        ) from None
    own = Path(here, *module.split("."))
    found = Path(getattr(imported, "__file__", None) or "")
    if (own.with_suffix(".py").is_file() or own.is_dir()) and not found.is_relative_to(here):
        # A name Python had already imported (the standard library's string, a package's) hides the user's file.
        raise ConfigError(
            f"reward {spec}: {module} is already the module at {found}, not {own}.py; rename your "
            "file (and the spec) to a name Python does not already use"
        )
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
    raise ConfigError(
        f"unknown reward {spec!r}: use {', '.join(BUILT_IN)} or module:function (a function(prompt, "
        "completion, row) -> float in module.py of the working directory)"
    )


class RewardProcess:
    """A reward (any spec load_reward takes) run in a process of its own, called as reward(prompt, completion, row).

    Every way a call can end other than with a finite number is a RewardError naming the reward: an exception or
    a non-number (as load_reward's rewards say), sys.exit, os._exit, a crash or a kill from outside, and a call
    still running after `seconds` (its process is then killed). A SIGINT or SIGTERM during a call ends it at once,
    after the signal's own handler ran, as a RewardError marked interrupted. A process that failed is replaced at
    the next call; one left is killed when this object goes (or the interpreter exits).
    """

    def __init__(self, spec: str, seconds: float) -> None:
        self.name, self.seconds = spec, seconds
        self.directory = os.getcwd()  # where module:function is imported from, as load_reward does
        self.worker: LineWorker | None = None
        self._start()  # a spec that names nothing usable is a ConfigError now, before any work

    def check_rows(self, rows: list[dict[str, Any]]) -> None:
        """A ConfigError naming the first row (by index) that lacks what the reward needs."""
        reply = self._ask({"rows": rows}, self.seconds + START_S, "checking the prompt rows")
        if "error" in reply:
            raise ConfigError(reply["error"])

    def __call__(self, prompt: str, completion: str, row: dict[str, Any]) -> float | None:
        """The completion's reward (None where it does not apply); RewardError if the call does not end with a finite
        number or None by the deadline."""
        reply = self._ask({"prompt": prompt, "completion": completion, "row": row}, self.seconds, "scoring")
        if "error" in reply:
            raise RewardError(reply["error"])
        return None if reply["value"] is None else float(reply["value"])

    def close(self) -> None:
        """Kill the reward's process (a later call starts another)."""
        if self.worker is not None:
            self._finalizer()
            self.worker = None

    def _start(self) -> LineWorker:
        """A new process with the reward loaded; ConfigError if the spec names nothing usable."""
        self.worker = LineWorker((*WORKER_COMMAND, self.name, self.directory), PACKAGE_ROOT, show_errors=True)
        self._finalizer = weakref.finalize(self, self.worker.kill)
        reply = self._ask(None, self.seconds + START_S, "loading")
        if "error" in reply:
            self.close()
            raise ConfigError(reply["error"])
        return self.worker

    def _ask(self, request: dict[str, Any] | None, seconds: float, doing: str) -> dict[str, Any]:
        """The process's reply to request (None: the reply it sends once loaded) within seconds; how it failed to
        reply otherwise, as a RewardError."""
        worker = self.worker or self._start()
        try:
            with signals_end_waits():
                return worker.ask(request, time.monotonic() + seconds)
        except TimeoutError:
            self.close()
            problem = (
                f"was still {doing} after {seconds:g} s, so its process was stopped (finetune.reward_timeout is "
                f"{self.seconds:g} s)"
            )
        except (EOFError, OSError):  # the process ended: sys.exit is answered, so os._exit, a crash or a kill
            self.worker = None
            self._finalizer.detach()
            problem = f"ended its process while {doing} ({worker.ended()})"
        except ValueError:
            self.close()
            problem = f"wrote something other than an answer while {doing}"
        except Interrupted as err:
            self.close()
            raise RewardError(
                f"{err} came while reward {self.name} was {doing}; it was stopped", interrupted=True
            ) from None
        except BaseException:  # (a request that cannot be sent, a second Ctrl-C): the process's state is unknown
            self.close()
            raise
        raise RewardError(f"reward {self.name} {problem}")


def reward_worker() -> None:
    """The loop of a reward's process (RewardProcess starts it with the spec and the working directory): load the
    reward, reply {"ready"} (or {"error"}), then reply to each request line, {"rows"} with {"ok"} and
    {"prompt", "completion", "row"} with {"value"}, or either with {"error"}."""
    requests, replies = child_pipes()
    exit_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # (a Ctrl-C reaches the whole process group): the parent decides
        signal.signal(sig, signal.SIG_IGN)
    spec, directory = sys.argv[1:3]
    os.chdir(directory)  # `python -c` put "" first on the path: the module is found here, as load_reward finds it
    try:
        reward = load_reward(spec)
    except ConfigError as err:
        send_line(replies, {"error": str(err)})
        return
    except BaseException as err:  # the module's own code ended the process (sys.exit) while it was imported
        send_line(replies, {"error": f"reward {spec}: importing its module {_ended_by(err)}"})
        return
    send_line(replies, {"ready": True})
    for line in requests:
        send_line(replies, _reply(reward, json.loads(line)))


def _reply(reward: Reward, request: dict[str, Any]) -> dict[str, Any]:
    """A reward process's reply to one request."""
    try:
        if "rows" in request:
            reward.check_rows(request["rows"])
            return {"ok": True}
        return {"value": reward(request["prompt"], request["completion"], request["row"])}
    except (ConfigError, RewardError) as err:
        return {"error": str(err)}
    except BaseException as err:  # the user's code: whatever ends it (sys.exit too) is reported as theirs
        return {"error": f"reward {reward.name} {_ended_by(err)}"}


def _ended_by(err: BaseException) -> str:
    """How user code ended, in words: 'called sys.exit(3)', or 'raised TypeError: ...'."""
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return f"raised {type(err).__name__}: {_one_line(str(err))}"
