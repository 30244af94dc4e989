"""The benchmark scripts still start: their imports and flags follow the library (timings are never asserted)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
BENCHMARKS = sorted(BENCH_DIR.glob("bench_*.py"))


def test_there_are_benchmarks():
    assert {path.name for path in BENCHMARKS} >= {"bench_generate.py", "bench_train.py", "bench_serve.py"}


@pytest.mark.parametrize("script", BENCHMARKS, ids=[path.stem for path in BENCHMARKS])
def test_benchmark_help_runs(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.slow  # 12 s; its --help runs by default, the training it times in test_train.py
def test_bench_train_smoke_run_reports_both_loops():
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_train.py"),
            "--shapes",
            "cpu-recipe",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--breakdown",
            "--breakdown-steps",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    shape = report["shapes"]["cpu-recipe"]
    assert shape["gptkit"]["steps"] == 2 and shape["hf"]["steps"] == 2
    assert shape["gptkit"]["ms_per_step"] > 0 and 0 < shape["hf_over_gptkit_time"] < 100
    for loop in ("gptkit", "hf"):  # both models run matrix products and SDPA attention, and the parts add up
        parts = report["breakdown"][loop]
        assert parts["matmul"] > 0 and parts["attention"] > 0 and parts["optimizer"] > 0
        named = parts["matmul"] + parts["attention"] + parts["optimizer"] + parts["rest"]
        assert parts["total"] == pytest.approx(named)
        assert parts["rest"] > 0
    assert set(report["breakdown"]["optimizer_phase_ms"]) == {"fused", "foreach", "compiled"}


# gptkit's LoRA and the peer's run by default (each is a process that imports torch: all eight took 45 s of the
# default suite's time, which CI bounds); the slow suite runs all eight, the full fine-tune, GRPO's and the int8 ones
# among them (tests/finetune covers those methods themselves).
FINETUNE_KINDS = ["gptkit lora", "hf+peft lora"]
FINETUNE_ALL = FINETUNE_KINDS + [
    "gptkit full",
    "gptkit lora int8 ckpt",
    "gptkit grpo G=1",
    "gptkit grpo G=8",
    "gptkit lora bf16 base",
    "gptkit lora int8 base",
]


@pytest.mark.parametrize(
    "configs", [FINETUNE_KINDS, pytest.param(FINETUNE_ALL, marks=pytest.mark.slow)], ids=["gptkit-and-peft", "all"]
)
def test_bench_finetune_smoke_run_reports_every_configuration(configs):
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_finetune.py"),
            "--preset",
            "tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--rank",
            "2",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--json",
            "--configs",
            *configs,
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert list(report["results"]) == configs  # in the order asked for, the GRPO ones run apart included
    lora = report["results"]["gptkit lora"]
    assert lora["trainable_params"] == report["results"]["hf+peft lora"]["trainable_params"]  # the same adapters
    assert lora["trainable_params"] > 0 and report["lora_speedup_over_peft"] > 0 and lora["peak_mb"] > 0
    if configs == FINETUNE_KINDS:
        return
    assert report["results"]["gptkit full"]["trainable_params"] > lora["trainable_params"]
    assert report["int8_ckpt_lora_peak_vs_full"] > 0
    g1, g8 = report["results"]["gptkit grpo G=1"], report["results"]["gptkit grpo G=8"]
    assert g8["completion_tokens"] >= 1 and g1["sample_s"] > 0 and g8["sample_s"] > 0
    # Both GRPO configurations timed in one process, alternating (the order reversed in the second round).
    assert report["grpo_schedule"] == ["gptkit grpo G=1", "gptkit grpo G=8", "gptkit grpo G=8", "gptkit grpo G=1"]
    assert report["grpo_g8_step_vs_g1"] == pytest.approx(g8["seconds_per_step"] / g1["seconds_per_step"])
    assert report["grpo_g8_sampling_vs_g1"] == pytest.approx(g8["sample_s"] / g1["sample_s"])


@pytest.mark.slow  # 6 s; its --help runs by default, the checkpoint it times in test_train.py
def test_bench_checkpoint_smoke_run_saves_both_ways_and_verifies():
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_checkpoint.py"),
            "--preset",
            "shakespeare-char-cpu",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["save_s"]) == {"manifest", "fsync only"} and all(len(v) == 1 for v in report["save_s"].values())
    assert report["checksum"] == "xxh3_64" and report["checkpoint_gb"] > 0 and report["verify_s"] >= 0


def test_bench_gguf_says_where_llama_cpp_is_missing(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_gguf.py"), "--llama-cpp", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode != 0 and "no llama-simple in" in result.stderr


@pytest.mark.slow  # 7 s; the structured outputs themselves are tested in test_structured.py, its --help here
def test_bench_structured_smoke_run_compares_and_validates():
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_structured.py"),
            "--part",
            "cost",
            "--shape",
            "llama-15m",
            "--vocab-size",
            "300",
            "--steps",
            "3",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    cost = json.loads(result.stdout)["cost"]
    assert cost["free_ms"] > 0 and cost["constrained_ms"] > 0 and cost["vocab_size"] == 300
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_structured.py"),
            "--part",
            "validity",
            "--samples",
            "1",
            "--max-tokens",
            "40",
            "--train-steps",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    validity = json.loads(result.stdout)["validity"]
    assert len(validity) == 2 and all(row["replies"] == row["schemas"] >= 20 for row in validity.values())
    assert all(sum(row["finish_reasons"].values()) == row["replies"] for row in validity.values())


@pytest.mark.slow  # 9 s on a CPU; its --help runs by default, and its parts run for real on a GPU
def test_bench_gpu_smoke_run_on_the_cpu_reports_every_part(tmp_path):
    """The GPU benchmark's code paths, on the CPU with a tiny model (its figures are only meaningful on a GPU)."""
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "bench_gpu.py"),
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--block",
            "32",
            "--batch",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--log-every",
            "1",
            "--rounds",
            "1",
            "--no-compile",
            "--dtype",
            "float32",
            "--decode-dtype",
            "float32",
            "--new-tokens",
            "4",
            "--prompt-len",
            "8",
            "--batch-sizes",
            "1,2",
            "--lora-rank",
            "2",
            "--muon-steps",
            "4",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == json.loads((tmp_path / "bench_gpu.json").read_text()) and not report["errors"]
    assert report["env"]["matmul_flops"] > 0 and report["loss"]["gpu_slices_ms"] > 0
    train = report["train"]
    assert set(train["loops"]) == {"gptkit eager", "hf eager"} and train["gptkit_over_hf_eager"] > 0
    assert train["gptkit train"]["tokens_per_s"] > 0 and 0 < train["loops"]["gptkit eager"]["mfu"] < 1
    for batch in ("1", "2"):
        row = report["decode"]["batches"][batch]
        assert row["hf generate"] > 0 and row["gptkit eager over hf"] > 0
    lora = report["lora"]["loops"]
    assert lora["gptkit lora"]["trainable_params"] == lora["hf+peft lora"]["trainable_params"] > 0
    assert report["attention"]["flash"]["ms"] > 0  # PyTorch's CPU flash kernel; the CUDA-only ones report errors
    assert report["profile"]["loop"] == "gptkit eager" and report["profile"]["by_kind_ms"]
    muon = report["muon"]
    assert [len(muon["runs"][name]) for name in ("adamw", "muon")] == [5, 5]  # evaluations at 0, 1, 2, 3 and 4 steps
    assert muon["val_loss_at_equal_steps"]["muon"] != muon["val_loss_at_equal_steps"]["adamw"]
    markdown = (tmp_path / "bench_gpu.md").read_text()
    assert "| gptkit eager |" in markdown and "Muon against AdamW" in markdown and "| kind of kernel |" in markdown


def test_bench_muon_smoke_run_times_each_way_on_the_records_batches():
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_muon.py"), "--rounds", "1", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # The CPU record's 8 matrices in 3 stacks, each wide side up; float32 either way within float32's rounding of
    # float64's iteration (measured at most 6e-6), bfloat16 within its own (measured 6e-3).
    assert sorted(r["shape"] for r in report["batches"]) == [[2, 128, 128], [2, 128, 384], [4, 128, 512]]
    for r in report["batches"]:
        assert r["float32"]["max_error"] < 2e-5 and r["float32 on the Gram matrix"]["max_error"] < 2e-5
        assert 1e-4 < r["bfloat16"]["max_error"] < 2e-2
        assert all(r[way]["ms"] > 0 for way in ("float32", "float32 on the Gram matrix", "bfloat16"))


def test_bench_kernels_smoke_run_times_every_format_on_both_sides():
    from gptkit.native import library

    if not library.load():
        pytest.skip("gptkit's CPU kernels are not built on this machine")
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_kernels.py"), "--rows", "1", "--rounds", "1", "--calls", "1", "--json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["format"] for r in report["results"]] == ["fp32", "bf16", "int8", "int4"]
    assert all(r["torch"]["us"] > 0 and r["gptkit"]["gb_s"] > 0 for r in report["results"])


def test_bench_kernels_streamed_smoke_run_times_each_row_count_against_reading():
    from gptkit.native import library

    if not library.load():
        pytest.skip("gptkit's CPU kernels are not built on this machine")
    command = [sys.executable, str(BENCH_DIR / "bench_kernels.py"), "--shapes", "gpt2-streamed", "--quick"]
    result = subprocess.run([*command, "--rows", "1,8", "--rounds", "1", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["rows"] for r in report["results"]] == [1, 8]
    assert all(r["ms"] > 0 and r["of_read"] == pytest.approx(r["read_ms"] / r["ms"]) for r in report["results"])


def test_bench_kernels_prefill_smoke_run_times_both_products_at_each_row_count(capsys, monkeypatch):
    from gptkit.native import library

    if not library.load():
        pytest.skip("gptkit's CPU kernels are not built on this machine")
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import bench_kernels  # in-process: the streamed smoke run above already starts the script as a program

    quick = ["--shapes", "gpt2-prefill", "--quick", "--rounds", "1"]
    assert bench_kernels.main([*quick, "--prefill-rows", "9,64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rows"] for r in report["results"]] == [9, 64]
    for r in report["results"]:
        assert r["ratio"] == pytest.approx(r["torch"]["ms"] / r["gptkit"]["ms"])
        assert r["gptkit"]["gflop_s"] == pytest.approx(2 * r["rows"] * 7_077_888 / r["gptkit"]["ms"] / 1e6)
    assert bench_kernels.main([*quick, "--prefill-rows", "8"]) == 2
    assert "--prefill-rows above it" in capsys.readouterr().err


def test_bench_quantization_smoke_run_scores_every_setting(tmp_path):
    import torch

    from gptkit.config import ModelConfig
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.model import GPT
    from gptkit.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model_dir = save_model_dir(
        GPT(ModelConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)),
        tmp_path / "model",
        ByteTokenizer(),
    )
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 10)
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_quantization.py"), str(model_dir), "--input", str(text), "--json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["models"][str(model_dir)]["rows"]
    assert list(rows) == ["fp32", "int8", "int4", "kv int8", "int4 + kv int8"]
    assert rows["fp32"]["perplexity_change"] == 0 and rows["int4"]["loss"] != rows["fp32"]["loss"]
    assert all(row["tokens"] == rows["fp32"]["tokens"] for row in rows.values())


@pytest.mark.slow
def test_bench_lm_eval_scores_alike_through_the_server_and_the_hf_backend():
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip('lm-eval is not installed (pip install "lm-eval[api]==0.4.13")')
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_lm_eval.py"), "--docs", "4", "--json"],
        capture_output=True,
        text=True,
        cwd=BENCH_DIR,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {(r["task"], r["metric"]): r for r in json.loads(result.stdout)["rows"]}
    assert rows[("gptkit_passages", "bits_per_byte")]["difference"] < 1e-6
    assert rows[("gptkit_choice", "acc")]["difference"] == 0
    assert rows[("gptkit_continue", "generations differing")]["served"] == 0


def test_bench_generate_smoke_run_decodes_the_tokens_transformers_decodes(capsys):
    """Both shapes (GPT-2's learned positions and tied head; Llama's RoPE, RMSNorm, SwiGLU and grouped heads), tiny,
    at batch sizes 1 and 2: gptkit's fp32 greedy tokens must be Hugging Face's, on the same random weights."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH_DIR / "bench_generate.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # in this process: a second interpreter would import torch again, seconds of it
    assert (
        bench.main(
            [
                "--shapes",
                "gpt2,llama",
                "--dtypes",
                "fp32",
                "--quantized",
                "",
                "--no-compile",
                "--n-layer",
                "2",
                "--n-embd",
                "64",
                "--vocab-size",
                "1000",
                "--prompt-len",
                "16",
                "--decode-prompt-len",
                "8",
                "--new-tokens",
                "6",
                "--batch-sizes",
                "1,2",
                "--rounds",
                "1",
                "--spec-steps",
                "0",
                "--probe-mb",
                "16",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    decode = [row for row in report["rows"] if row["measure"] != "prefill"]
    assert {(row["shape"], row["measure"]) for row in decode} == {
        (shape, f"decode b{b}") for shape in ("gpt2", "llama") for b in (1, 2)
    }
    assert all(row["same_tokens_as_hf"] is True for row in decode), decode
    assert all(row["gptkit"] > 0 and row["hf"] > 0 for row in report["rows"])
    assert report["timing_notes"] == []  # (said only where llama.cpp was timed)


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE_PREPARE = """
from pathlib import Path
text = Path("input.txt").read_text()
Path("train.bin").write_bytes(b"t" * 8)
Path("val.bin").write_bytes(b"v" * 8)
Path("prepared_chars.txt").write_text(str(len(text)))
"""
FAKE_TRAIN = """
import json, sys
from pathlib import Path
Path("args.json").write_text(json.dumps(sys.argv[1:]))
print("step 0: train loss 4.1700, val loss 4.1650")
print("iter 0: loss 4.1700, time 10.00ms")
print("step 20: train loss 2.5000, val loss 2.6123")
"""


def test_nanogpt_peer_runs_its_own_prepare_and_the_readme_command_in_a_copy(tmp_path):
    from gptkit.prepare import DEFAULT_CORPUS

    nanogpt_peer = _bench_module("nanogpt_peer")
    checkout = tmp_path / "nanoGPT"
    for name, text in {
        "train.py": FAKE_TRAIN,
        "model.py": "",
        "configurator.py": "",
        "config/train_shakespeare_char.py": "",
        "data/shakespeare_char/prepare.py": FAKE_PREPARE,
        "out-old/ckpt.pt": "stale",
    }.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    copy = nanogpt_peer.prepared_copy(checkout, tmp_path / "work")
    data = copy / "data" / "shakespeare_char"
    assert (data / "input.txt").read_bytes() == DEFAULT_CORPUS.read_bytes()  # the bundled corpus, not a download
    assert (data / "prepared_chars.txt").read_text() == str(len(DEFAULT_CORPUS.read_text()))
    assert not (copy / "out-old").exists() and not (checkout / "data" / "shakespeare_char" / "input.txt").exists()
    run = nanogpt_peer.timed_run(copy, tmp_path / "out", steps=20)
    assert run["steps"] == 20 and run["val_loss"] == 2.6123 and run["wall_s"] > 0  # the last evaluation's
    assert json.loads((copy / "args.json").read_text()) == [
        *nanogpt_peer.README_CPU_ARGS,
        "--max_iters=20",
        "--lr_decay_iters=20",
        "--eval_interval=20",
        "--warmup_iters=10",
        f"--out_dir={tmp_path / 'out'}",
    ]
    with pytest.raises(SystemExit, match="not a nanoGPT checkout .no train.py"):
        nanogpt_peer.prepared_copy(tmp_path / "work", tmp_path / "elsewhere")
    (copy / "train.py").write_text("import sys\nsys.exit('no CUDA here')\n")
    with pytest.raises(SystemExit, match=r"nanoGPT's train.py failed \(exit 1\)(.|\n)*no CUDA here"):
        nanogpt_peer.timed_run(copy, tmp_path / "out")
