"""lm-evaluation-harness run against `gptkit serve` as a user runs it, beside lm-eval's own Hugging Face backend.

    .venv/bin/pip install "lm-eval[api]==0.4.13"            # not among gptkit's dependencies
    .venv/bin/python benchmarks/bench_lm_eval.py               # a random char model built here
    .venv/bin/python benchmarks/bench_lm_eval.py --model-dir runs/shakespeare-char/checkpoints/step-002000

The model directory is exported with `gptkit convert --to-hf` (lm-eval's `hf` backend reads the export) and served
with `gptkit serve` on a free 127.0.0.1 port (lm-eval's `local-completions` backend, which finds the server's own
tokenizer at /tokenizer_info). Three tasks are written here from the Shakespeare text gptkit ships, so nothing is
downloaded: a rolling log-likelihood of passages (bits per byte), a four-way multiple choice (accuracy) and a
greedy continuation (exact match, and each generation compared with the other backend's). Prints each metric on
both sides and their difference; --json prints them as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from serve_process import start_server

CORPUS = Path(__file__).resolve().parent.parent / "gptkit" / "corpora" / "tinyshakespeare.txt"
TASKS = {
    "gptkit_passages": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "bits_per_byte"}, {"metric": "byte_perplexity"}],
    },
    "gptkit_choice": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc"}],
    },
    "gptkit_continue": {
        "output_type": "generate_until",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{continuation}}",
        "metric_list": [{"metric": "exact_match"}],
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12, "do_sample": False},
    },
}


def build_model_dir(path: Path) -> Path:
    """A random GPT-2-style char model of the shipped text with an end-of-text token (its scores are those of
    chance, but both backends must agree on them)."""
    import torch

    from gptkit.config import ModelConfig
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.model import GPT
    from gptkit.tokenizer import EOT, CharTokenizer

    tokenizer = CharTokenizer.train([CORPUS.read_text()], [EOT])
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64)
    return save_model_dir(GPT(config), path / "lm-eval-model", tokenizer=tokenizer)


def write_tasks(root: Path, docs: int, seed: int = 0) -> None:
    """The three tasks' YAML and JSONL data under root (lm-eval's --include_path)."""
    lines = [line for line in CORPUS.read_text().splitlines() if len(line) > 30]
    rng = random.Random(seed)
    picked = rng.sample(lines, 4 * docs)
    data = {
        "gptkit_passages": [{"text": "\n".join(lines[i : i + 6])} for i in rng.sample(range(len(lines) - 6), docs)],
        "gptkit_choice": [
            {"context": line[:20], "choices": [line[20:30]] + [o[20:30] for o in others], "label": 0}
            for line, *others in zip(*[iter(picked)] * 4)
        ],
        "gptkit_continue": [{"context": line[:20], "continuation": line[20:]} for line in picked[:docs]],
    }
    for name, spec in TASKS.items():
        rows = root / f"{name}.jsonl"
        rows.write_text("".join(json.dumps(row) + "\n" for row in data[name]))
        task = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(rows)}},
            "test_split": "test",
            **spec,
        }
        (root / f"{name}.yaml").write_text(json.dumps(task))  # JSON is YAML


def run_lm_eval(model: str, model_args: str, tasks: Path, out: Path) -> dict[str, Any]:
    """One lm_eval run; its results file (metrics and, with --log_samples, each document's answers)."""
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
    ]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"bench_lm_eval: lm_eval --model {model} failed:\n{result.stderr[-3000:]}")
    results = sorted(out.rglob("results_*.json"))[-1]
    samples = {name: [json.loads(line) for line in next(out.rglob(f"samples_{name}_*.jsonl")).open()] for name in TASKS}
    return {"results": json.loads(results.read_text())["results"], "samples": samples}


def compare(served: dict[str, Any], hf: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task metric: both values and their difference; then the generations that differ."""
    rows = []
    for task in TASKS:
        for key, value in served["results"][task].items():
            if isinstance(value, float) and not key.endswith("stderr,none"):
                other = hf["results"][task][key]
                rows.append(
                    {
                        "task": task,
                        "metric": key.removesuffix(",none"),
                        "served": value,
                        "hf": other,
                        "difference": abs(value - other),
                    }
                )
    mine = [s["resps"] for s in sorted(served["samples"]["gptkit_continue"], key=lambda s: s["doc_id"])]
    theirs = [s["resps"] for s in sorted(hf["samples"]["gptkit_continue"], key=lambda s: s["doc_id"])]
    rows.append(
        {
            "task": "gptkit_continue",
            "metric": "generations differing",
            "served": sum(a != b for a, b in zip(mine, theirs)),
            "hf": 0,
            "difference": None,
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="a gptkit model directory (default: random)")
    parser.add_argument("--docs", type=int, default=40, help="documents per task")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if importlib.util.find_spec("lm_eval") is None:
        raise SystemExit('bench_lm_eval: lm-eval is not installed: pip install "lm-eval[api]==0.4.13"')
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = args.model_dir or build_model_dir(root)
        hf_dir = root / "hf"
        subprocess.run(
            [sys.executable, "-m", "gptkit", "convert", "--to-hf", str(model_dir), "--out", str(hf_dir)],
            check=True,
            capture_output=True,
        )
        (root / "tasks").mkdir()
        write_tasks(root / "tasks", args.docs)
        proc, url = start_server(model_dir, max_batch_size=4, threads=None)
        try:
            import httpx

            card = httpx.get(url + "/v1/models").json()["data"][0]
            # lm-eval's API backends keep one token of max_length for a generation, and a rolling window one more
            # for its context: context_length + 2 gives the windows its hf backend uses on the same model.
            served = run_lm_eval(
                "local-completions",
                f"model={card['id']},base_url={url}/v1/completions,max_length={card['context_length'] + 2}",
                root / "tasks",
                root / "served",
            )
        finally:
            proc.terminate()
            proc.wait()
        hf = run_lm_eval("hf", f"pretrained={hf_dir},dtype=float32", root / "tasks", root / "hf-out")
    rows = compare(served, hf)
    if args.json:
        print(json.dumps({"model": str(args.model_dir or "random char model"), "rows": rows}, indent=2))
        return
    print(f"{'task':18} {'metric':24} {'gptkit serve':>14} {'hf backend':>14} {'difference':>11}")
    for row in rows:
        diff = "" if row["difference"] is None else f"{row['difference']:.1e}"
        print(f"{row['task']:18} {row['metric']:24} {row['served']:>14.8g} {row['hf']:>14.8g} {diff:>11}")


if __name__ == "__main__":
    main()
