"""examples/rl_demo.py: its options and the spread it reports over seeds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "rl_demo.py"


def demo() -> ModuleType:
    """The demo's module, loaded from its file (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("rl_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag, value", [("--seeds", "0"), ("--seeds", "two"), ("--seed", "-1")])
def test_a_bad_seed_option_is_a_one_line_usage_error(tmp_path, flag, value):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), flag, value, "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"argument {flag}: {value!r} is not a whole number" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "run").exists()  # nothing ran


def test_seed_options_choose_which_seeds_run():
    parse = demo().build_parser().parse_args
    assert (parse([]).seed, parse([]).seeds) == (1, 1)
    args = parse(["--seeds", "3", "--seed", "7"])
    assert list(range(args.seed, args.seed + args.seeds)) == [7, 8, 9]


def test_spread_gives_the_mean_least_and_most_before_and_after_rl():
    runs = [
        {"before_rl": {"pass@1": b1, "pass@8": b8}, "after_rl": {"pass@1": a1, "pass@8": a8}}
        for b1, b8, a1, a8 in [(0.5, 0.9, 0.8, 1.0), (0.25, 0.75, 0.75, 0.5), (0.75, 1.0, 0.5, 0.75)]
    ]
    figures = demo().spread(runs)
    assert figures["before_rl"]["pass@1"] == {"mean": 0.5, "min": 0.25, "max": 0.75}
    assert figures["after_rl"]["pass@8"] == {"mean": 0.75, "min": 0.5, "max": 1.0}
    gains = [0.3, 0.5, -0.25]
    assert figures["gain"]["pass@1"] == pytest.approx({"mean": sum(gains) / 3, "min": -0.25, "max": 0.5}, abs=1e-12)


@pytest.mark.slow
def test_a_quick_run_of_two_seeds_keeps_each_apart_and_summarises_both(tmp_path):
    out = tmp_path / "demo"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--seeds", "2", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=900,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [1, 2]
    assert [run["seed"] for run in summary["runs"]] == [1, 2]
    for seed in (1, 2):
        assert (out / f"seed-{seed}" / "rl" / "metrics.jsonl").is_file()
        config = (out / f"seed-{seed}" / "sft" / "config.yaml").read_text()
        assert f"seed: {seed}" in config
    before = [run["before_rl"]["pass@1"] for run in summary["runs"]]
    assert summary["before_rl"]["pass@1"]["min"] == min(before)


def test_a_run_stopped_early_resumes_and_a_finished_one_is_taken_as_it_is(tmp_path, monkeypatch):
    from gptkit.manifest import MANIFEST_FILE

    module, calls = demo(), []
    monkeypatch.setattr(module, "gptkit_cli", lambda *args: calls.append(args))
    run = tmp_path / "sft"

    def checkpoint(step: int) -> None:
        folder = run / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / MANIFEST_FILE).write_text("{}")

    assert module.train(tmp_path / "data", run, 2000, 1, []) == run / "checkpoints" / "step-002000"
    assert calls[-1][:2] == ("train", "--data")  # nothing there: a fresh run
    checkpoint(16)  # what a Ctrl-C leaves: the old demo took this partial model as the finished one
    module.train(tmp_path / "data", run, 2000, 1, [])
    assert calls[-1][:2] == ("train", "--resume") and calls[-1][calls[-1].index("--train.max_steps") + 1] == "2000"
    checkpoint(2000)
    module.train(tmp_path / "data", run, 2000, 1, [])
    assert len(calls) == 2  # finished: not trained again
