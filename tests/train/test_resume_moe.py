"""A mixture-of-experts run resumes bit for bit (issue 55): 8 steps straight against 5, then a resume to 8, with the
balance and z losses on, dropout, and the routing statistics each evaluation logs; under AdamW and under Muon (which
orthogonalises each expert's matrix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import write_char_data_dir

from gptkit.checkpoint import latest_checkpoint
from gptkit.run_sources import from_sources
from gptkit.tensors import load_tensors
from gptkit.train import train

MOE_MODEL = dict(
    n_layer=2,
    n_head=2,
    n_embd=16,
    block_size=16,
    dropout=0.1,
    norm="rmsnorm",
    position="rope",
    activation="swiglu",
    n_experts=4,
    n_experts_per_token=2,
    moe_ffn_hidden=16,
    moe_aux_loss=0.01,
    moe_z_loss=0.001,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_char_data_dir(tmp_path_factory.mktemp("data"), 30_000)


def run_config(data_dir: Path, out: Path, optimizer: str, max_steps: int = 8):
    train_settings = dict(
        data_dir=str(data_dir),
        out_dir=str(out),
        max_steps=max_steps,
        batch_size=4,
        eval_interval=4,
        eval_iters=2,
        log_interval=1,
        checkpoint_interval=3,
        device="cpu",
        plot=False,
        observe=False,  # the in-context measures: seconds an evaluation, nothing of the routing
    )
    optim = {"name": optimizer, "warmup_steps": 2, "decay_steps": 8, "lr": 3e-3}
    return from_sources(None, {"model": dict(MOE_MODEL), "optim": optim, "train": train_settings})


def records(run_dir: Path) -> dict[int, dict]:
    """step -> its loss, lr and gradient norm, and at the evaluations of steps 0, 4 and 8 its validation loss and
    routing statistics (a run stopped at step 5 evaluates there too, which the straight run does not)."""
    kept = ("loss", "lr", "grad_norm", "val_loss", "moe_tokens_per_expert", "moe_load_cv", "moe_router_entropy")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out: dict[int, dict] = {}
    for record in lines:
        step = record["step"]
        keys = kept if step % 4 == 0 else kept[:3]
        out.setdefault(step, {}).update({k: record[k] for k in keys if k in record})
    return out


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("muon", marks=pytest.mark.slow)])  # ~30-50 s each
def test_an_moe_run_resumes_bit_for_bit(optimizer, data_dir, tmp_path):
    reference = train(run_config(data_dir, tmp_path / "ref", optimizer), progress=False).run_dir
    out = tmp_path / "run"
    train(run_config(data_dir, out, optimizer, max_steps=5), progress=False)  # checkpoints at 3 and 5
    train(run_config(data_dir, out, optimizer), resume=True, progress=False)
    got, want = records(out), records(reference)
    assert got == want and len(got) == 9  # step 0's evaluation, then 8 steps
    assert {"moe_load_cv", "moe_tokens_per_expert", "moe_router_entropy"} <= want[8].keys()
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = (load_tensors(latest_checkpoint(run) / name) for run in (out, reference))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
