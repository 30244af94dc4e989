"""bench_speculation's training recipe: its first stage is watch_it_learn's recipe (the one shown to grow an
induction head), and each later one starts from the checkpoint before it at the full context."""

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_speculation as bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def flags_of(command: list[str]) -> dict[str, str]:
    """A command's --section.key value pairs."""
    return {arg[2:]: value for arg, value in zip(command, command[1:]) if arg.startswith("--") and "." in arg}


def test_the_copy_stage_trains_watch_it_learns_recipe():
    recipe = yaml.safe_load((ROOT / "configs" / "watch-it-learn.yaml").read_text())
    flags = flags_of(bench.stage_command(Path("out"), 0, 5000, None))
    for section in ("model", "optim"):
        for key in ("n_layer", "n_head", "n_embd", "block_size", "ffn_hidden", "activation", "position", "lr"):
            if key in recipe[section]:
                assert yaml.safe_load(flags[f"{section}.{key}"]) == recipe[section][key], key
        for key in ("weight_decay", "beta1", "beta2", "grad_clip", "warmup_steps"):
            if key in recipe[section]:
                assert float(flags[f"{section}.{key}"]) == recipe[section][key], key
    assert int(flags["train.batch_size"]) == recipe["train"]["batch_size"]
    assert "model.init_from" not in flags


def test_each_later_stage_starts_from_the_one_before_at_the_full_context():
    counts = bench.stage_steps(bench.TRAIN_STEPS)
    assert sum(counts) == bench.TRAIN_STEPS and counts[0] == max(counts)
    for index in range(1, len(bench.STAGES)):
        before = bench.STAGES[index - 1]["name"]
        start = Path("out") / f"{before}-run" / "checkpoints" / f"step-{counts[index - 1]:06d}"
        flags = flags_of(bench.stage_command(Path("out"), index, counts[index], start))
        assert flags["model.init_from"] == str(start)
        assert int(flags["model.block_size"]) == 512 and int(flags["train.max_steps"]) == counts[index]
    assert min(bench.stage_steps(10)) >= 1 and sum(bench.stage_steps(10)) == 10  # --smoke: every stage runs
