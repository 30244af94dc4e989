"""`gptkit plan --budget`: the answer to the question asked is the first line printed."""

from __future__ import annotations

from gptkit.cli import main


def test_a_budget_is_answered_on_the_first_line(capsys):
    assert main(["plan", "gpt2", "--budget", "1e21"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("a budget of 1.00 ZFLOP is best spent on ") and lines[0].endswith("(C = 6ND, D = 20N)")
    assert sum(line.startswith("a budget of") for line in lines) == 1


def test_without_a_budget_the_model_comes_first(capsys):
    assert main(["plan", "gpt2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpt2: ") and sum(line.startswith("a budget of") for line in lines) == 1
