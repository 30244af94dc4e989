"""LoRA on a mixture-of-experts model (issue 55): its attention layers adapt and train; targets reaching the experts'
(E, out, in) weights are refused in one line until LoRA on experts exists."""

from __future__ import annotations

import pytest
import torch
from helpers import byte_model_dir, reversal_rows, write_jsonl

from gptkit.adapters import adapters, add_lora
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.model import GPT
from gptkit.tensors import load_tensors
from gptkit.train import train
from tests.finetune.test_finetune import _losses, _run_config


def moe_fields() -> dict:
    """A Mixtral-like model's switches: every layer 4 experts, top 2."""
    return dict(norm="rmsnorm", position="rope", activation="swiglu", n_experts=4, n_experts_per_token=2)


@pytest.mark.parametrize("targets", ["all", "mlp"])
def test_lora_targets_reaching_the_experts_are_refused_by_layer(targets):
    model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, **moe_fields()))
    with pytest.raises(ConfigError, match=rf"lora_targets '{targets}' reaches blocks\.0\.mlp\.fc, a mixture of "):
        add_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=targets)
    assert not adapters(model) and all(p.requires_grad for p in model.parameters())  # left as it was


def test_a_lora_run_on_an_moe_base_trains_its_attention_and_refuses_its_experts(tmp_path, capsys):
    base = byte_model_dir(tmp_path / "base", **moe_fields())
    data = tmp_path / "data"
    rows = write_jsonl(tmp_path / "chat.jsonl", reversal_rows(40))
    assert main(["prepare", "--input", str(rows), "--tokenizer", str(base), "--out", str(data)]) == 0
    attention = dict(method="lora", lora_rank=4, lora_targets="attention", train={"max_steps": 2})
    run = train(_run_config(data, tmp_path / "run", base, **attention), progress=False)
    losses = _losses(run.run_dir)
    assert set(losses) == {1, 2} and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    state = load_tensors(run.checkpoint / "adapters.safetensors")
    assert state and all(".attn." in name for name in state)
    assert any(name.endswith("lora_B") and t.abs().sum() > 0 for name, t in state.items())  # a step moved B from 0
    config = _run_config(data, tmp_path / "all", base, method="lora", train={"max_steps": 1})  # default: all
    with pytest.raises(ConfigError, match=r"reaches blocks\.0\.mlp\.fc, a mixture of experts' 4 expert weights"):
        train(config, progress=False)


def test_adapters_train_over_a_bfloat16_moe_base_whose_experts_stay_float32():
    from gptkit.formats.lora import with_precision

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, **moe_fields()))
    add_lora(with_precision(model, "bfloat16"), rank=4, alpha=8.0, dropout=0.0, targets="attention")
    assert model.blocks[0].mlp.fc.weight.dtype == torch.float32
    assert type(model.blocks[0].attn.qkv.base).__name__ == "Bfloat16Linear"
    ids = torch.randint(0, 64, (2, 16))
    model(ids, targets=ids).backward()
    assert all(a.lora_A.grad is not None for a in adapters(model).values())


def test_an_int8_moe_base_holds_int8_expert_stacks_and_trains_its_attention_adapters():
    from gptkit.formats.lora import with_precision
    from gptkit.quantization import Int8Experts

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, **moe_fields()))
    add_lora(with_precision(model, "int8"), rank=4, alpha=8.0, dropout=0.0, targets="attention")
    assert type(model.blocks[0].mlp.fc) is Int8Experts and model.blocks[0].mlp.router.weight.dtype == torch.float32
    model.train()
    ids = torch.randint(0, 64, (2, 16))
    model(ids, targets=ids).backward()  # the grouped path through the dequantised stacks carries x's gradient
    assert all(a.lora_A.grad is not None for a in adapters(model).values())
