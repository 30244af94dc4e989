"""gptkit's HF exports run in vLLM (the CPU backend, `make vllm`): a GPT-2-style, a Llama-style, a merged-LoRA and a
Qwen3-MoE model each decode the same greedy tokens with logprobs within 1e-4 of gptkit's, and vLLM renders a chat
with the export's template into the prompt ids gptkit renders.

vLLM runs in its own venv, in a subprocess (tests/formats/vllm_run.py): .venv-vllm at the repository root, or the
Python that $GPTKIT_VLLM_PYTHON names. Without either the tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import REPO

from gptkit.adapters import adapters, add_lora, merge_lora
from gptkit.config import ModelConfig
from gptkit.formats.modeldir import save_model_dir
from gptkit.loading import chat_template, export_hf
from gptkit.model import GPT
from gptkit.tokenizer import EOT, ByteTokenizer

RUNNER = Path(__file__).with_name("vllm_run.py")
SPECIALS = [EOT, "<|im_start|>", "<|im_end|>"]
# vLLM's CPU attention kernels take head sizes of 32, 64, 80, 96, 112, 128, 256 (not gptkit's tiny 8): 64 here.
# block_size: a chat in the default template is ~100 byte tokens.
SHAPE = dict(block_size=192, n_layer=2, n_head=4, n_embd=256)
LLAMA = dict(
    SHAPE,
    norm="rmsnorm",
    position="rope",
    activation="swiglu",
    n_kv_head=2,
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    tie_embeddings=False,
)
MODELS = {
    "gpt2": (dict(SHAPE), None),
    "llama": (LLAMA, None),
    "llama-merged-lora": (LLAMA, None),
    "qwen3-moe": (dict(LLAMA, qk_norm=True, n_experts=4, n_experts_per_token=2, moe_ffn_hidden=128), "qwen3_moe"),
}
PROMPTS = [[72, 101, 108, 108, 111], [10, 84, 104, 101, 32, 113, 117, 105], [33]]
MAX_TOKENS = 12
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi ✓"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather?"},
]
# Measured: vLLM's fp32 CPU logprobs differ from gptkit's by at most 6.1e-6 on these models (2.3e-6 to 6.1e-6 a
# model; its kernels add in another order); the bound is 1e-4.
LOGPROB_TOLERANCE = 1e-4


def vllm_python() -> Path | None:
    """The Python of vLLM's venv: $GPTKIT_VLLM_PYTHON, else .venv-vllm's, else None."""
    named = os.environ.get("GPTKIT_VLLM_PYTHON")
    candidate = Path(named) if named else REPO / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.exists() else None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed: `make vllm` or set GPTKIT_VLLM_PYTHON"),
]


def tiny_model(name: str, vocab_size: int) -> GPT:
    """A random model of the case's shape whose weights are wide enough that greedy choices are decisive."""
    settings, _ = MODELS[name]
    torch.manual_seed(0)
    model = GPT(ModelConfig(**dict(settings, vocab_size=vocab_size))).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:  # matrices only: norms keep their gains of one
                param.normal_(0.0, 0.08)
    if name == "llama-merged-lora":
        add_lora(model, rank=4, alpha=8.0, dropout=0.0, targets="all")
        with torch.no_grad():  # a trained adapter's B is not zero: without this the merge would change nothing
            for adapter in adapters(model).values():
                adapter.lora_B.normal_(0.0, 0.05)
        model = merge_lora(model)
    return model


def gptkit_greedy(model: GPT, prompt: list[int]) -> tuple[list[int], list[float], float]:
    """gptkit's greedy tokens after prompt, each one's log-probability, and the smallest top-2 logit margin seen."""
    ids, logprobs, margin = list(prompt), [], float("inf")
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids]))[0, -1].double()  # (V,)
            top = torch.topk(logits, 2).values
            margin = min(margin, float(top[0] - top[1]))
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs, margin


def run_vllm(hf_dir: Path, tmp_path: Path, expert_parallel: bool) -> dict:
    """What vllm_run.py reports for the export at hf_dir."""
    job = dict(
        model=str(hf_dir),
        prompts=PROMPTS,
        max_tokens=MAX_TOKENS,
        max_model_len=SHAPE["block_size"],
        messages=MESSAGES,
        expert_parallel=expert_parallel,
    )
    (tmp_path / "job.json").write_text(json.dumps(job))
    # a small KV cache and no thread pinning: the test shares a small machine with others
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [str(vllm_python()), str(RUNNER), str(tmp_path / "job.json"), str(tmp_path / "result.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.parametrize("name", list(MODELS))
def test_vllm_decodes_gptkits_export_as_gptkit_does(name: str, tmp_path: Path) -> None:
    tokenizer = ByteTokenizer(SPECIALS)
    model = tiny_model(name, tokenizer.vocab_size)
    source = save_model_dir(model, tmp_path / "model", tokenizer=tokenizer)
    hf_dir = export_hf(source, tmp_path / "hf", family=MODELS[name][1])
    result = run_vllm(hf_dir, tmp_path, expert_parallel=model.config.n_experts is not None)
    for prompt, theirs in zip(PROMPTS, result["decoded"], strict=True):
        tokens, logprobs, margin = gptkit_greedy(model, prompt)
        assert margin > 1e-3, "the model's greedy choices are near ties: the comparison would not be decisive"
        assert theirs["tokens"] == tokens
        assert max(abs(a - b) for a, b in zip(theirs["logprobs"], logprobs)) <= LOGPROB_TOLERANCE
    text = chat_template(source, tokenizer).render(MESSAGES, add_generation_prompt=True)
    assert result["chat_prompt_ids"] == tokenizer.encode(text)
