"""Reward functions for RL from verifiable rewards: the built-ins on hand-made completions, and a user's module
loaded from the working directory, each failure one line naming it."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gptkit.errors import ConfigError
from gptkit.finetune.rewards import Reward, RewardError, final_answer, load_reward


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("46", "46", 1.0),
        ("  46\n", 46, 1.0),
        ("47", "46", 0.0),
        ("Add them: 12 + 34 = 46.\n#### 46", "46", 1.0),
        ("#### 46 is my guess, #### 47", "46", 0.0),  # the LAST mark counts
        ("The total is 46", "46", 0.0),  # no mark: the whole completion is the answer
        ("#### 1,000", "1000", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("#### 1,234,567.50", 1234567.5, 1.0),
        ("46.0", "46", 1.0),
        ("46", 46.0, 1.0),
        ("-3", "-3.00", 1.0),
        ("1,00", "100", 0.0),  # not a thousands comma: compared as text
        ("Paris", "Paris", 1.0),
        ("paris", "Paris", 0.0),
    ],
    ids=str,
)
def test_exact_match_compares_the_final_answer(completion: str, answer, want: float) -> None:
    value = load_reward("exact_match")("What?", completion, {"answer": answer})
    assert type(value) is float and value == want


def test_final_answer_is_after_the_last_mark() -> None:
    assert final_answer("a #### b #### c ") == "c" and final_answer(" no mark ") == "no mark"


def test_exact_match_checks_every_row_has_an_answer() -> None:
    reward = load_reward("exact_match")
    reward.check_rows([{"answer": "1"}, {"answer": 2}])
    with pytest.raises(ConfigError, match=r"needs a 'answer' field .* prompt 1 has none \(its fields: 'prompt'\)"):
        reward.check_rows([{"answer": "1"}, {"prompt": "x"}])
    with pytest.raises(ConfigError, match=r"prompt 0's \"answer\" must be a string or a number, got list"):
        reward.check_rows([{"answer": [1]}])


def test_regex_hits_and_misses_and_a_bad_pattern_is_named() -> None:
    reward = load_reward(r"regex:^\d+$")
    assert reward.name == r"regex:^\d+$"
    assert reward("p", "123", {}) == 1.0 and reward("p", "12a", {}) == 0.0
    assert load_reward("regex:cat")("p", "a cat sat", {}) == 1.0  # found anywhere (re.search)
    with pytest.raises(ConfigError, match=r"reward regex:\(ab: the pattern is not a valid regular expression"):
        load_reward("regex:(ab")


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    "completion, want",
    [
        ('{"n": 3}', 1.0),
        (' {"n": 3}\n', 1.0),
        ('{"n": "3"}', 0.0),  # JSON, not valid against the schema
        ('{"m": 3}', 0.0),
        ("n = 3", 0.0),  # not JSON
        ('{"n": 3', 0.0),
        ("[" * 100_000, 0.0),  # deeper than the parser follows
    ],
)
def test_json_schema_scores_valid_json_only(completion: str, want: float) -> None:
    pytest.importorskip("jsonschema")
    reward = load_reward("json_schema")
    assert reward("p", completion, {"schema": SCHEMA}) == want
    assert (
        reward(
            "p",
            completion,
            {"schema": '{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}'},
        )
        == want
    )  # as JSON text


def test_json_schema_checks_rows_and_needs_jsonschema(monkeypatch) -> None:
    pytest.importorskip("jsonschema")
    reward = load_reward("json_schema")
    reward.check_rows([{"schema": SCHEMA}])
    with pytest.raises(ConfigError, match="needs a 'schema' field .* prompt 0 has none"):
        reward.check_rows([{"answer": 1}])
    with pytest.raises(ConfigError, match='prompt 1\'s "schema" is not a valid JSON schema: .*must be a JSON object'):
        reward.check_rows([{"schema": SCHEMA}, {"schema": "[1]"}])
    with pytest.raises(ConfigError, match='prompt 0\'s "schema" is not a valid JSON schema: 3 is not valid'):
        reward.check_rows([{"schema": {"type": 3}}])
    unresolvable = {"schema": {"properties": {"n": {"$ref": "urn:gptkit-test:nowhere"}}}}
    with pytest.raises(
        RewardError,
        match='reward json_schema: validating against the row\'s "schema" failed: .*'
        "Unresolvable: urn:gptkit-test:nowhere",
    ):
        reward("p", '{"n": 1}', unresolvable)
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # as if it were not installed
    with pytest.raises(
        ConfigError, match="reward json_schema validates with the jsonschema package: pip install jsonschema"
    ):
        load_reward("json_schema")


USER_MODULE = """
import math

def length(prompt, completion, row):
    return len(completion) / row["scale"]

def boom(prompt, completion, row):
    raise ValueError("no digits in\\n" + completion)

def text(prompt, completion, row):
    return "x"

def nothing(prompt, completion, row):
    pass

def nan(prompt, completion, row):
    return math.nan

def yes(prompt, completion, row):
    return True

not_callable = 3
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch) -> Iterator[str]:
    """A module written to the working directory, under a name no other test imports."""
    name = f"rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory stays on it after a load: not past this
    yield name
    sys.modules.pop(name, None)


def test_a_user_function_from_the_working_directory(user_module: str, tmp_path: Path) -> None:
    reward = load_reward(f"{user_module}:length")
    assert sys.path[0] == str(tmp_path)  # kept, as `python -m` keeps it: the function may import its helpers later
    assert isinstance(reward, Reward) and reward.name == f"{user_module}:length"
    value = reward("prompt", "abcd", {"scale": 8})
    assert type(value) is float and value == 0.5
    reward.check_rows([{}])  # a user's function says itself what it needs
    assert load_reward(f"{user_module}:nothing")("prompt", "42", {}) is None  # None: the reward does not apply


@pytest.mark.parametrize(
    "function, message",
    [
        ("boom", "reward function {m}:boom raised ValueError: no digits in 42"),
        ("text", "reward function {m}:text returned 'x' (str), not a number; return an int or a float"),
        ("yes", "reward function {m}:yes returned True (bool), not a number"),
        ("nan", "reward function {m}:nan returned nan, not a finite number"),
    ],
)
def test_a_failing_user_function_is_one_line_naming_it(user_module: str, function: str, message: str) -> None:
    reward = load_reward(f"{user_module}:{function}")
    with pytest.raises(RewardError) as caught:
        reward("prompt", "42", {})
    assert str(caught.value).startswith(message.format(m=user_module)) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "no_such_module_here:score",
            "reward no_such_module_here:score: no module 'no_such_module_here' in the working directory",
        ),
        ("{m}:missing", "reward {m}:missing: module {m} has no 'missing'; define def missing(prompt, completion, row)"),
        ("{m}:not_callable", "reward {m}:not_callable: {m}.not_callable is a int, not a function"),
        ("{m}:", "reward '{m}:' is not module:function"),
        ("cheer", "unknown reward 'cheer': use exact_match, regex:PATTERN, json_schema or module:function"),
    ],
)
def test_an_unusable_spec_is_one_line_naming_it(user_module: str, spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_reward(spec.format(m=user_module))
    assert str(caught.value).startswith(message.format(m=user_module)) and "\n" not in str(caught.value)


def test_a_module_that_fails_to_import_is_named(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "broken_reward_mod.py").write_text("import not_installed_anywhere\n")
    (tmp_path / "raising_reward_mod.py").write_text("raise RuntimeError('bad setup')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match="reward broken_reward_mod:f: importing broken_reward_mod failed: No module "
        "named 'not_installed_anywhere'",
    ):
        load_reward("broken_reward_mod:f")
    with pytest.raises(ConfigError, match="importing raising_reward_mod raised RuntimeError: bad setup"):
        load_reward("raising_reward_mod:f")


def test_a_user_function_may_import_its_helpers_when_called(user_module: str, tmp_path: Path) -> None:
    (tmp_path / f"{user_module}_lazy.py").write_text(
        f"def score(prompt, completion, row):\n    import {user_module}_helper\n    return {user_module}_helper.ONE\n"
    )
    (tmp_path / f"{user_module}_helper.py").write_text("ONE = 1.0\n")
    try:
        assert load_reward(f"{user_module}_lazy:score")("p", "c", {}) == 1.0
    finally:
        for name in (f"{user_module}_lazy", f"{user_module}_helper"):
            sys.modules.pop(name, None)


def test_a_module_named_like_one_python_has_loaded_is_refused_in_one_line(user_module: str, tmp_path: Path) -> None:
    (tmp_path / "string.py").write_text("def score(prompt, completion, row):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"reward string:score: string is already the module at .*rename your file"):
        load_reward("string:score")
