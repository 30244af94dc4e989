"""What the demonstrations that pre-train on the bundled corpus share: gptkit's commands run as a user types them,
and the flags of the byte-level pre-training (classify_demo.py, finetune_demo.py)."""

from __future__ import annotations

import shlex
import subprocess
import sys

# A byte-level shakespeare-char-cpu model at 128 bytes of context; the caller adds the steps and the warm-up.
PRETRAIN = [
    "--model.preset",
    "shakespeare-char-cpu",
    "--model.block_size",
    "128",
    "--train.batch_size",
    "16",
    "--optim.lr",
    "2e-3",
    "--optim.min_lr",
    "2e-4",
    "--optim.beta2",
    "0.99",
    "--train.eval_interval",
    "500",
    "--train.eval_iters",
    "10",
    "--train.checkpoint_interval",
    "500",
]


def gptkit_cli(*args: str, capture: bool = False) -> str:
    """Run one gptkit command, showing it as a user would type it; its standard output if capture, else ""."""
    print("$ gptkit " + shlex.join(args), flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "gptkit", *args], check=True, text=True, stdout=subprocess.PIPE if capture else None
    )
    return done.stdout or ""
