"""Training settings: generated flags, YAML recipes, one-line errors before any work, schedule and decay groups."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.cli import build_parser, main
from gptkit.config import ModelConfig, resolve_model
from gptkit.errors import ConfigError
from gptkit.model import GPT
from gptkit.optim import lr_at, param_groups
from gptkit.run_sources import from_sources
from gptkit.tokenizer import CharTokenizer
from gptkit.train_config import OptimConfig, RunConfig, TrainConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A small char-level data directory."""
    text = (REPO / "gptkit" / "corpora" / "tinyshakespeare.txt").read_text()[:20_000]
    tokenizer = CharTokenizer.train([text])
    ids = np.asarray(tokenizer.encode(text), dtype=np.uint16)
    path = tmp_path_factory.mktemp("data")
    ids[:18_000].tofile(path / "train.bin")
    ids[18_000:].tofile(path / "val.bin")
    tokenizer.save(path)
    meta = {
        "vocab_size": tokenizer.vocab_size,
        "dtype": "uint16",
        "train_tokens": 18_000,
        "val_tokens": len(ids) - 18_000,
        "tokenizer": "char",
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(["train", *argv])
    return code, capsys.readouterr().err


def flags_of(argv: list[str]) -> RunConfig:
    from gptkit.cli.train import build_config

    return build_config(build_parser().parse_args(["train", *argv]))


def test_flags_are_generated_from_the_dataclasses():
    parser_help = build_parser().parse_args(["train"])  # no flags: nothing overridden
    assert not [k for k in vars(parser_help) if k.startswith("cfg:")]
    text = " ".join(
        a
        for action in build_parser()._subparsers._group_actions[0].choices["train"]._actions
        for a in action.option_strings
    )
    for f in fields(ModelConfig):
        assert f"--model.{f.name}" in text
    for section, cls in (("optim", OptimConfig), ("train", TrainConfig)):
        for f in fields(cls):
            assert f"--{section}.{f.name}" in text
    for name in ("lr", "min_lr", "warmup_steps", "schedule", "weight_decay", "beta1", "beta2", "grad_clip"):
        assert f"--optim.{name}" in text
    for name in (
        "max_steps",
        "batch_size",
        "grad_accum",
        "eval_interval",
        "eval_iters",
        "log_interval",
        "checkpoint_interval",
        "keep_checkpoints",
        "seed",
        "device",
        "dtype",
        "compile",
    ):
        assert f"--train.{name}" in text


def test_precedence_defaults_yaml_flags(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  preset: shakespeare-char-cpu\n  n_layer: 3\noptim:\n  lr: 3e-4\ntrain:\n  seed: 7\n")
    config = flags_of(
        [
            "--config",
            str(recipe),
            "--optim.lr",
            "1e-3",
            "--model.dropout",
            "0.1",
            "--train.compile",
            "true",
            "--train.peak_flops",
            "1e12",
        ]
    )
    assert config.optim.lr == 1e-3 and config.train.seed == 7 and config.train.compile is True
    assert config.train.peak_flops == 1e12
    assert config.optim.beta2 == OptimConfig().beta2  # untouched keys keep the dataclass default
    assert config.train.out_dir == str(Path("runs") / "r")  # named after the recipe
    model = resolve_model(config.model, vocab_size=65)
    assert (model.n_layer, model.n_embd, model.dropout, model.vocab_size) == (3, 128, 0.1, 65)
    assert model.ffn_hidden == 4 * 128 and model.attn_bias is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim.lr", "fast"], "optim.lr must be a number, got 'fast'"),
        (["--train.max_steps", "1.5"], "train.max_steps must be an integer, got 1.5"),
        (["--train.compile", "maybe"], "train.compile must be true or false"),
        (["--optim.schedule", "linear"], "optim.schedule must be one of cosine, constant"),
        (["--train.device", "tpu"], "train.device must be one of auto, cpu, cuda, mps"),
        (["--model.n_layer", "two"], "model.n_layer must be an integer"),
        (["--model.activation", "tanh"], "model.activation must be one of relu"),
        (["--model.preset", "gpt5"], "unknown preset 'gpt5'"),
        (["--train.max_steps", "0"], "train.max_steps must be >= 1"),
        (["--optim.beta1", "1.5"], "optim.beta1 must be in [0.0, 1.0)"),
        (["--optim.lr=-1e-3"], "optim.lr must be > 0.0"),
        (["--optim.lr", "nan"], "optim.lr must be > 0.0, got nan"),
        (["--optim.min_lr=-0.01"], "optim.min_lr must be between 0 and optim.lr"),
        (["--optim.weight_decay=-1"], "optim.weight_decay must be >= 0.0"),
        (["--optim.grad_clip=-1"], "optim.grad_clip must be >= 0 (0 turns clipping off)"),
        (["--optim.decay_steps", "0"], "optim.decay_steps must be >= 1"),
        (["--train.seed=-1"], "train.seed must be >= 0"),
        (["--train.peak_flops=-1"], "train.peak_flops must be > 0.0"),
        (["--out", "{data}/meta.json"], "is a file; give a directory"),
        (["--model.vocab_size", "50"], "model.vocab_size 50 does not match the data's vocab_size"),
        (["--train.dtype", "float16", "--train.device", "cpu"], "float16 needs CUDA"),
    ],
)
def test_bad_values_are_one_line_errors_before_any_work(argv, message, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [arg.format(data=data_dir) for arg in argv]
    code, err = run_cli(["--data", str(data_dir), "--out", str(out), "--model.n_layer", "1", *argv], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("gptkit train: error: ") and message in err, err
    assert not (out / "checkpoints").exists()


def test_string_settings_keep_the_flag_text_as_typed():
    config = flags_of(["--train.data_dir", "2024", "--train.out_dir", "yes", "--model.init_from", "null"])
    assert (config.train.data_dir, config.train.out_dir, config.model.init_from) == ("2024", "yes", None)


def test_yaml_errors(tmp_path, data_dir, capsys):
    cases = {
        "model:\n  n_layers: 2\n": "unknown config key 'model.n_layers'; did you mean 'n_layer'?",
        "optim:\n  learning_rate: 0.1\n": "unknown config key 'optim.learning_rate'",
        "training:\n  max_steps: 2\n": "unknown section 'training'",
        "train:\n  batch_size: [1, 2]\n": "train.batch_size must be an integer",
        "train: [1\n": "is not valid YAML",
    }
    for text, message in cases.items():
        recipe = tmp_path / "bad.yaml"
        recipe.write_text(text)
        code, err = run_cli(["--config", str(recipe), "--data", str(data_dir)], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, (text, err)
    code, err = run_cli(["--config", str(tmp_path / "missing.yaml")], capsys)
    assert code == 2 and "does not exist" in err


def test_missing_data_and_runs_that_exist(tmp_path, data_dir, capsys):
    code, err = run_cli(["--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err and "gptkit prepare" in err
    code, err = run_cli(["--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "pass --data DIR" in err
    code, err = run_cli(["--data", str(data_dir), "--out", str(tmp_path / "r"), "--resume"], capsys)
    assert code == 2 and "does not exist: there is no run to resume (start it without --resume)" in err
    assert not (tmp_path / "r").exists()


def test_cli_run_then_resume_and_guards(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    tiny = [
        "--data",
        str(data_dir),
        "--out",
        str(out),
        "--quiet",
        "--model.n_layer",
        "1",
        "--model.n_head",
        "2",
        "--model.n_embd",
        "16",
        "--model.block_size",
        "8",
        "--train.batch_size",
        "2",
        "--train.eval_iters",
        "1",
        "--train.max_steps",
        "2",
        "--train.eval_interval",
        "2",
        "--train.keep_checkpoints",
        "1",
    ]
    code, err = run_cli(tiny, capsys)
    assert code == 0 and "step 2" in err
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, err = run_cli(tiny, capsys)  # the same run again, without --resume
    assert code == 2 and "already holds a run; pass --resume" in err
    code, err = run_cli([*tiny, "--resume", "--model.n_layer", "2"], capsys)
    assert code == 2 and "model.n_layer cannot change on --resume" in err
    code, err = run_cli([*tiny, "--resume", "--train.max_steps", "3"], capsys)  # same flags + more steps
    assert code == 0, err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000003"]  # keep_checkpoints 1
    assert (out / "latest").read_text().strip() == "checkpoints/step-000003"


def test_init_from_vocab_mismatch(tmp_path, data_dir, capsys):
    from gptkit.formats.modeldir import save_model_dir

    model_dir = save_model_dir(
        GPT(ModelConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=16)), tmp_path / "m"
    )
    code, err = run_cli(
        ["--data", str(data_dir), "--out", str(tmp_path / "r"), "--model.init_from", str(model_dir)], capsys
    )
    assert code == 2 and err.count("\n") == 1 and "has vocab_size 50 but the data's is" in err


def test_recipes_are_nanogpts():
    cpu = from_sources(REPO / "configs" / "shakespeare-char-cpu.yaml", {})
    model = resolve_model(cpu.model, vocab_size=65)
    assert (model.n_layer, model.n_head, model.n_embd, model.block_size, model.dropout) == (4, 4, 128, 64, 0.0)
    assert (model.attn_bias, model.mlp_bias, model.norm_bias, model.activation, model.tie_embeddings) == (
        False,
        False,
        False,
        "gelu",
        True,
    )
    o, t = cpu.optim, cpu.train
    assert (o.lr, o.min_lr, o.warmup_steps, o.decay_steps, o.beta1, o.beta2) == (1e-3, 1e-4, 100, 2000, 0.9, 0.99)
    assert (o.weight_decay, o.grad_clip, o.schedule) == (0.1, 1.0, "cosine")
    assert (t.max_steps, t.batch_size, t.grad_accum, t.eval_interval, t.eval_iters, t.log_interval) == (
        2000,
        12,
        1,
        250,
        20,
        1,
    )
    assert (t.device, t.dtype, t.compile) == ("cpu", "float32", False)
    gpu = from_sources(REPO / "configs" / "shakespeare-char.yaml", {})
    model = resolve_model(gpu.model, vocab_size=65)
    shape = (model.n_layer, model.n_embd, model.block_size, model.dropout, gpu.train.batch_size)
    assert shape == (6, 384, 256, 0.2, 64)
    assert (gpu.train.max_steps, gpu.train.eval_iters, gpu.optim.decay_steps) == (5000, 200, 5000)
    gpt2 = from_sources(REPO / "configs" / "gpt2-124m.yaml", {})
    model = resolve_model(gpt2.model, vocab_size=50257)
    assert (model.n_layer, model.n_embd, model.block_size) == (12, 768, 1024)
    assert (gpt2.optim.lr, gpt2.optim.min_lr, gpt2.optim.warmup_steps, gpt2.optim.beta2) == (6e-4, 6e-5, 2000, 0.95)
    # nanoGPT's 40 micro-batches per update over 8 processes: grad_accum counts one process's.
    assert (gpt2.train.batch_size, 8 * gpt2.train.grad_accum, gpt2.train.max_steps, gpt2.train.dtype) == (
        12,
        40,
        600000,
        "bfloat16",
    )


def test_lr_schedule_is_nanogpts_get_lr():
    o = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=100, decay_steps=2000)

    def nanogpt(it: int) -> float:  # nanoGPT train.py get_lr, written out from its definition
        if it < 100:
            return 1e-3 * (it + 1) / (100 + 1)
        if it > 2000:
            return 1e-4
        ratio = (it - 100) / (2000 - 100)
        return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    for step in (0, 1, 50, 99, 100, 101, 500, 1050, 1999, 2000, 2500):
        assert lr_at(step, o, max_steps=2000) == pytest.approx(nanogpt(step), rel=1e-12), step
    const = OptimConfig(lr=1e-3, warmup_steps=10, schedule="constant")
    assert lr_at(5, const, 100) == pytest.approx(1e-3 * 6 / 11) and lr_at(90, const, 100) == 1e-3
    # decay_steps defaults to max_steps.
    assert lr_at(99, OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0), 100) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 0.99))
    )


def test_weight_decay_only_on_matrices():
    config = ModelConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config)
    decay, no_decay = param_groups(model, 0.1)
    names = {p: n for n, p in model.named_parameters()}
    decayed = {names[p] for p in decay["params"]}
    assert "tok_emb.weight" in decayed and "pos_emb.weight" in decayed and "blocks.0.attn.qkv.weight" in decayed
    assert all(names[p].endswith(("bias", "norm1.weight", "norm2.weight", "norm_f.weight")) for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # Every parameter exactly once (the tied head shares the token embedding).
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert sum(p.numel() for p in decay["params"] + no_decay["params"]) == sum(p.numel() for p in model.parameters())
    assert isinstance(decay["params"][0], torch.nn.Parameter)


def test_each_part_declares_its_settings_once_and_help_names_the_part(capsys):
    from gptkit.finetune.catalogue import METHODS, OBJECTIVES, part_keys, part_settings
    from gptkit.run_sources import new_run_config
    from gptkit.train_config import FinetuneConfig

    owners = part_settings()
    keys = part_keys()
    assert {f.name for f in fields(FinetuneConfig)} == {"method", "objective", "packing", "parts"}
    assert {"lora_rank", "dpo_beta", "orpo_beta", "kto_beta", "loss_type", "lm_weight"} <= set(keys)
    assert set(new_run_config().finetune.parts) == set(owners)  # every part's settings, by class
    for name, part in {**METHODS, **OBJECTIVES}.items():
        if part.settings_type in owners:
            assert owners[part.settings_type].endswith(f" {name}")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--finetune.orpo_beta VALUE orpo: weight of the odds-ratio term" in shown
    assert "--finetune.lora_rank VALUE lora: r: the adapters' inner width" in shown


def test_a_setting_of_a_part_the_run_does_not_use_is_warned_about(tmp_path, caplog):
    from gptkit.finetune.catalogue import check_parts

    config = from_sources(None, {"train": {"out_dir": str(tmp_path / "run")}, "finetune": {"dpo_beta": 0.3}})
    check_parts(config)
    assert "finetune.dpo_beta is a setting of finetune.objective dpo, which this run does not use" in caplog.text


@pytest.mark.parametrize(
    "finetune, train, message",
    [
        ({"method": "lora"}, {}, "finetune.method lora trains adapters over a base model: set model.init_from"),
        ({"objective": "dpo"}, {"parallel": "fsdp"}, "finetune.objective dpo aligns an existing model"),
        (
            {"objective": "orpo"},
            {"parallel": "fsdp"},
            "finetune.objective orpo trains under train.parallel ddp; use ddp",
        ),
    ],
)
def test_a_part_declares_its_run_rules_and_the_catalogue_enforces_them(tmp_path, finetune, train, message):
    from gptkit.finetune.catalogue import check_parts

    config = from_sources(None, {"train": {"out_dir": str(tmp_path / "run"), **train}, "finetune": finetune})
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        check_parts(config)
    config.model.init_from = str(tmp_path / "base")
    config.train.parallel = "ddp"
    check_parts(config)  # both rules kept: nothing to refuse


def test_list_and_nested_model_settings_take_flags_and_describe_themselves():
    from gptkit.run_sources import section_types
    from gptkit.settings import coerce, describe

    kinds = section_types("model")
    assert describe(kinds["layer_types"]) == "a list of values, each one of full, sliding or null"
    assert coerce("model.layer_types", ["full", "sliding"], kinds["layer_types"]) == ["full", "sliding"]
    with pytest.raises(
        ConfigError,
        match=r"^model.layer_types must be a list of values, each one of full, sliding or "
        r"null, got \['full', 'local'\]$",
    ):
        coerce("model.layer_types", ["full", "local"], kinds["layer_types"])
    assert describe(kinds["nope_layers"]) == "a list of integers or null"
    rope = {"rope_type": "linear", "factor": 2.0}
    assert coerce("model.rope_scaling", rope, kinds["rope_scaling"]) == rope  # ModelConfig checks its fields
    with pytest.raises(ConfigError, match=r"^model.rope_scaling must be a mapping of RopeScaling's fields or null"):
        coerce("model.rope_scaling", "linear", kinds["rope_scaling"])
    config = from_sources(None, {"model": {"preset": "tiny-llama", "rope_scaling": rope, "layer_types": ["full"] * 2}})
    assert config.model.fields["rope_scaling"] == rope


def test_a_nested_setting_takes_a_yaml_mapping_as_a_flag(tmp_path):
    from gptkit.run_sources import flag_overrides

    args = build_parser().parse_args(
        ["train", "--model.rope_scaling", "{rope_type: linear, factor: 4}", "--model.block_size", "512"]
    )
    flags = flag_overrides(args)
    assert flags["model"] == {"rope_scaling": {"rope_type": "linear", "factor": 4}, "block_size": 512}
    config = from_sources(None, {"model": {"preset": "tiny-llama", **flags["model"]}})
    assert resolve_model(config.model, 256).rope_scaling.factor == 4.0
    args = build_parser().parse_args(["train", "--model.rope_scaling", "linear"])
    with pytest.raises(ConfigError, match="^model.rope_scaling must be a mapping of RopeScaling's fields or null"):
        from_sources(None, flag_overrides(args))
