"""The mixture-of-experts feed-forward (gptkit.moe): routing, the grouped products, the balance losses, statistics."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from gptkit import moe
from gptkit.accounting import active_params, forward_flops_per_token, param_breakdown
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.layers import activate
from gptkit.model import GPT, FeedForward


def moe_config(**overrides: object) -> ModelConfig:
    """A tiny MoE config: 4 experts, top-2, hidden 8 (widths multiples of 4, so fp32 takes torch._grouped_mm)."""
    fields = {
        "vocab_size": 32,
        "block_size": 16,
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 16,
        "activation": "swiglu",
        "mlp_bias": False,
        "n_experts": 4,
        "n_experts_per_token": 2,
        "moe_ffn_hidden": 8,
    }
    fields.update(overrides)
    return ModelConfig(**fields)


def make_layer(config: ModelConfig, seed: int = 0) -> moe.MoEFeedForward:
    torch.manual_seed(seed)
    shared = None
    if config.moe_shared_hidden is not None:
        shared = FeedForward(dataclasses.replace(config, ffn_hidden=config.moe_shared_hidden))
    layer = moe.MoEFeedForward(config, shared)
    with torch.no_grad():  # larger than GPT's init, so that the outputs and their differences are not tiny
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def dense_reference(layer: moe.MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then each token's router-weighted sum over its top-k: the definition, unfused."""
    flat = x.reshape(-1, x.size(-1))
    probs = layer.router(flat).float().softmax(-1)
    top, chosen = probs.topk(layer.k, dim=-1)
    if layer.renormalize:
        top = top / top.sum(-1, keepdim=True)
    gate = torch.zeros_like(probs).scatter(1, chosen, top)  # (N, E): zero for the experts not chosen
    outputs = []
    for e in range(layer.n_experts):
        h = flat @ layer.fc.weight[e].T
        if layer.fc.bias is not None:
            h = h + layer.fc.bias[e]
        y = activate(h, layer.activation) @ layer.proj.weight[e].T
        outputs.append(y + layer.proj.bias[e] if layer.proj.bias is not None else y)
    out = (torch.stack(outputs, 1) * gate[..., None]).sum(1)
    if layer.shared is not None:
        shared = layer.shared(flat)
        out = out + (torch.sigmoid(layer.shared_gate(flat)) * shared if layer.shared_gate is not None else shared)
    return out.view_as(x)


def test_route_by_hand() -> None:
    # softmax([2, 1, 0, 1]) = [e^2, e, 1, e] / (e^2 + 2e + 1); top-2 = experts 0 and 1 (1 and 3 tie: the lower wins).
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.0]])
    z = math.e**2 + 2 * math.e + 1
    weights, experts = moe.route(logits, 2, renormalize=False)
    assert experts.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[math.e**2 / z, math.e / z]]))
    weights, experts = moe.route(logits, 2, renormalize=True)
    # Renormalised = Mixtral's softmax over the top-k logits [2, 1].
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0]]).softmax(-1))
    torch.testing.assert_close(weights, torch.tensor([[math.e / (math.e + 1), 1 / (math.e + 1)]]))


def test_ties_go_to_the_lower_expert() -> None:
    logits = torch.zeros(3, 6)
    logits[1, 4] = 1.0
    _, experts = moe.route(logits, 3, renormalize=True)
    assert experts.tolist() == [[0, 1, 2], [4, 0, 1], [0, 1, 2]]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"moe_renormalize": False, "moe_shared_hidden": 12, "moe_shared_gate": True},
        {"activation": "gelu", "mlp_bias": True, "n_experts_per_token": 1},
        {"n_embd": 6, "n_head": 2, "moe_ffn_hidden": 5, "activation": "geglu", "moe_shared_hidden": 7},  # the loop
    ],
)
def test_grouped_equals_dense_reference(overrides: dict) -> None:
    config = moe_config(**overrides)
    layer, reference = make_layer(config), make_layer(config)
    x = torch.randn(3, 7, config.n_embd, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = layer(x1), dense_reference(reference, x2)
    # fp32 sums of <= 16 products in another order: measured differences about 1e-6 on values about 1-10.
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_grouped_product_equals_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    config = moe_config()
    layer = make_layer(config)
    x = torch.randn(2, 9, config.n_embd)
    grouped = layer(x)
    monkeypatch.setattr(moe, "_uses_grouped_mm", lambda x, weight: False)
    torch.testing.assert_close(layer(x), grouped, rtol=0, atol=0)  # same groups, same kernels row by row


# The second: widths that are no multiple of 4, the loop over experts (narrower products, below 8 columns, gave a row
# other bits by its place among the 8 rows of a block: MKL's kernel, not the routing).
@pytest.mark.parametrize("overrides", [{}, {"n_embd": 18, "n_head": 2, "moe_ffn_hidden": 10}])
def test_a_tokens_output_does_not_depend_on_the_others(overrides: dict) -> None:
    # Batches of one size, so that the dense products (router, shared expert) take the same kernels: what differs is
    # which other tokens share the token's experts, and so how many rows each expert's product has.
    config = moe_config(n_experts=8, n_experts_per_token=3, moe_shared_hidden=12, **overrides)
    layer = make_layer(config).eval()
    g = torch.Generator().manual_seed(2)
    token = torch.randn(config.n_embd, generator=g)
    for size in (2, 9, 64, 300):
        outputs = []
        for _ in range(3):
            batch = torch.randn(1, size, config.n_embd, generator=g)
            batch[0, size // 2] = token
            outputs.append(layer(batch)[0, size // 2])
        assert all(torch.equal(out, outputs[0]) for out in outputs), size


def test_load_balance_and_its_gradient_against_the_formula() -> None:
    torch.manual_seed(3)
    E, k, N = 4, 2, 6
    logits = torch.randn(N, E, requires_grad=True)
    probs = logits.softmax(-1)
    _, experts = moe.route(logits.detach(), k, renormalize=True)
    value = moe.load_balance(probs, experts, E)
    # By hand: f_e = slots choosing e / (N k); P_e = mean_i p_ie; E * sum_e f_e P_e.
    f = [sum(int(e in row) for row in experts.tolist()) / (N * k) for e in range(E)]
    p = [sum(probs[i, e].item() for i in range(N)) / N for e in range(E)]
    assert value.item() == pytest.approx(E * sum(fe * pe for fe, pe in zip(f, p)), rel=1e-6)
    # d/d logits_ij = E / N * sum_e f_e p_ie (delta_je - p_ij): the softmax Jacobian times the constant f.
    value.backward()
    pj = probs.detach()
    fe = torch.tensor(f)
    expected = E / N * pj * (fe[None] - (pj * fe[None]).sum(-1, keepdim=True))
    torch.testing.assert_close(logits.grad, expected)


def test_balance_is_one_when_uniform() -> None:
    logits = torch.zeros(8, 4)
    experts = torch.arange(8).remainder(4)[:, None]  # every expert chosen twice
    assert moe.load_balance(logits.softmax(-1), experts, 4).item() == pytest.approx(1.0)


def test_z_loss_and_the_layers_auxiliary_loss() -> None:
    config = moe_config(moe_aux_loss=0.1, moe_z_loss=0.01)
    layer = make_layer(config).train()
    x = torch.randn(2, 5, config.n_embd)
    layer(x)
    logits = layer.router(x.reshape(-1, config.n_embd))
    _, experts = moe.route(logits, 2, renormalize=True)
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    expected = 0.1 * moe.load_balance(logits.softmax(-1), experts, 4) + 0.01 * z
    torch.testing.assert_close(layer.aux_loss, expected)
    assert moe.auxiliary_loss(layer) is not None and layer.aux_loss is None  # read once
    with torch.no_grad():
        layer(x)
    assert layer.aux_loss is None  # nothing to train, nothing kept
    layer.eval()
    layer(x)
    assert moe.auxiliary_loss(layer) is None


def test_routing_metrics() -> None:
    config = moe_config()
    layer = make_layer(config).eval()
    assert moe.routing_metrics(layer) == {}
    moe.start_routing_count(layer)
    x = torch.randn(1, 10, config.n_embd)
    with torch.no_grad():
        layer(x)
        layer(x)
    logits = layer.router(x[0]).detach()
    _, experts = moe.route(logits, 2, renormalize=True)
    counts = 2 * torch.bincount(experts.reshape(-1), minlength=4)
    metrics = moe.routing_metrics(layer)
    assert metrics["moe_tokens_per_expert"] == [counts.tolist()]
    cv = counts.double().std(correction=0) / counts.double().mean()
    assert metrics["moe_load_cv"] == pytest.approx(float(cv))
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    assert metrics["moe_router_entropy"] == pytest.approx(float(entropy), rel=1e-5)
    assert layer.counts is None and moe.routing_metrics(layer) == {}  # counting stopped


def test_config_fields() -> None:
    config = moe_config(moe_layer_step=2, moe_dense_layers=[1], n_layer=4)
    assert [config.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    assert moe_config(moe_ffn_hidden=None).expert_hidden == moe_config(moe_ffn_hidden=None).ffn_hidden
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert not ModelConfig.preset("tiny").is_moe_layer(0)
    for bad, words in [
        ({"n_experts_per_token": 5}, "at most n_experts"),
        ({"moe_aux_loss": -0.1}, "moe_aux_loss must be >= 0"),
        ({"moe_shared_gate": True}, "set moe_shared_hidden"),
        ({"n_experts": None}, "need n_experts"),
        ({"moe_dense_layers": [7]}, "layer indices"),
    ]:
        with pytest.raises(ConfigError, match=words):
            moe_config(**bad)


def tiny_moe_model(seed: int = 0, **overrides: object) -> GPT:
    fields = {"position": "rope", "norm": "rmsnorm", "n_kv_head": 1, "moe_shared_hidden": 12, "moe_shared_gate": True}
    fields.update(overrides)
    torch.manual_seed(seed)
    return GPT(moe_config(**fields))


def test_dense_layers_of_an_moe_config_are_the_dense_model() -> None:
    dense = tiny_moe_model(n_experts=None, moe_ffn_hidden=None, moe_shared_hidden=None, moe_shared_gate=False)
    all_dense = tiny_moe_model(moe_dense_layers=[0, 1])
    assert list(all_dense.state_dict()) == list(dense.state_dict())
    assert not any("router" in name or "shared" in name for name in dense.state_dict())
    ids = torch.randint(0, 32, (2, 8))
    assert torch.equal(all_dense(ids), dense(ids))


def test_moe_model_layers_and_names() -> None:
    model = tiny_moe_model(moe_layer_step=2)
    assert isinstance(model.blocks[1].mlp, moe.MoEFeedForward) and isinstance(model.blocks[0].mlp, FeedForward)
    names = {name for name in model.state_dict() if name.startswith("blocks.1.mlp.")}
    expected = {
        "router.weight",
        "fc.weight",
        "proj.weight",
        "shared.fc.weight",
        "shared.proj.weight",
        "shared_gate.weight",
    }
    assert names == {"blocks.1.mlp." + name for name in expected}
    assert model.blocks[1].mlp.fc.weight.shape == (4, 16, 16)  # (E, [gate; up] of hidden 8, n_embd)


def test_the_auxiliary_losses_train_with_the_loss_and_only_then() -> None:
    model = tiny_moe_model(moe_aux_loss=0.5, moe_z_loss=0.25).train()
    ids, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    loss = model(ids, targets=targets)
    captured: list[torch.Tensor] = []  # each MoE layer's input, to recompute its terms from
    hooks = [b.mlp.register_forward_pre_hook(lambda m, args: captured.append(args[0])) for b in model.blocks]
    again = model(ids, targets=targets)
    for hook in hooks:
        hook.remove()
    terms = []
    for block, x in zip(model.blocks, captured):
        router_logits = block.mlp.router(x.reshape(-1, 16)).float()
        _, experts = moe.route(router_logits, 2, renormalize=True)
        balance = moe.load_balance(router_logits.softmax(-1), experts, 4)
        terms.append(0.5 * balance + 0.25 * moe.router_z_loss(router_logits))
    model.eval()
    plain = model(ids, targets=targets)
    torch.testing.assert_close(again, plain + torch.stack(terms).mean())
    assert torch.equal(loss, again)
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0


def test_a_sequences_logits_do_not_depend_on_the_other_rows() -> None:
    model = tiny_moe_model(n_experts=8, n_experts_per_token=3).eval()
    sequence = torch.randint(0, 32, (12,))
    outputs = []
    for seed in range(3):
        batch = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(seed))
        batch[2] = sequence
        outputs.append(model(batch)[2])
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_cached_decoding_matches_the_full_forward() -> None:
    from gptkit.kv_cache import KVCache

    model = tiny_moe_model().eval()
    ids = torch.randint(0, 32, (1, 10))
    full = model(ids)
    cache = KVCache(model.config, batch_size=1, max_len=16)
    steps = [model(ids[:, :6], cache=cache)]
    steps += [model(ids[:, t : t + 1], cache=cache, start_pos=t) for t in range(6, 10)]
    # fp32, 2 layers: measured differences about 1e-7; a wrong expert would differ by about the logits themselves.
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_training_logs_routing_statistics(tmp_path: Path) -> None:
    from helpers import write_char_data_dir

    from gptkit.run_sources import from_sources
    from gptkit.train import train

    data_dir = write_char_data_dir(tmp_path, 20_000)
    model = {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 16,
        "block_size": 16,
        "activation": "swiglu",
        "mlp_bias": False,
        "n_experts": 4,
        "n_experts_per_token": 2,
        "moe_ffn_hidden": 8,
        "moe_aux_loss": 0.01,
        "moe_z_loss": 0.001,
    }
    train_settings = {
        "data_dir": str(data_dir),
        "out_dir": str(tmp_path / "run"),
        "max_steps": 4,
        "batch_size": 4,
        "eval_interval": 2,
        "eval_iters": 2,
        "log_interval": 1,
        "checkpoint_interval": 4,
        "device": "cpu",
        "plot": False,
        "sample_every": 0,  # samples: tests/observe/test_observe_training.py (most of such a run's time)
    }
    result = train(from_sources(None, {"model": model, "train": train_settings}), progress=False)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "val_loss" in r]
    assert evaluated
    for record in evaluated:
        per_layer = record["moe_tokens_per_expert"]
        # Both splits' eval_iters x batch_size windows of block_size tokens, k slots each, in each of the 2 layers.
        assert [sum(counts) for counts in per_layer] == [2 * 2 * 4 * 16 * 2] * 2
        assert 0 <= record["moe_load_cv"] and 0 < record["moe_router_entropy"] <= math.log(4) + 1e-6


PUBLISHED = json.loads((Path(__file__).parents[1] / "fixtures" / "moe_configs.json").read_text())
MOE_PRESETS = [name for name in PUBLISHED if not name.startswith("_")]


def counts_by_hand(hf: dict) -> tuple[int, int]:
    """(total, active) parameters of a Llama-style MoE decoder from its config.json: embeddings and head, per layer
    q, k, v, o, q/k norms (Qwen3-MoE per head, OLMoE over the width), the router, E experts of three matrices (k of
    them active) and two norms, and the final norm."""
    d, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    hd, kv = hf.get("head_dim", d // heads), hf["num_key_value_heads"]
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    expert = 3 * d * hf.get("moe_intermediate_size", hf["intermediate_size"])
    attention = 2 * d * heads * hd + 2 * d * kv * hd
    qk_norms = 2 * hd if "head_dim" in hf else (heads + kv) * hd if "norm_topk_prob" in hf else 0
    shared = attention + qk_norms + d * experts + 2 * d
    embeddings = hf["vocab_size"] * d * (1 if hf["tie_word_embeddings"] else 2)
    total = embeddings + layers * (shared + experts * expert) + d
    return total, embeddings + layers * (shared + hf["num_experts_per_tok"] * expert) + d


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_presets_have_the_published_counts(name: str) -> None:
    entry = PUBLISHED[name]
    assert counts_by_hand(entry["config"]) == (entry["parameters"], entry["active"])
    config = ModelConfig.preset(name)
    assert param_breakdown(config).total == entry["parameters"]
    assert active_params(config) == entry["active"]
    for key, count in (("total", entry["parameters"]), ("active", entry["active"])):
        # The published figures in billions, within one unit of their last digit (Qwen's 3.3B is 3.35 truncated).
        published = entry["published"][key]
        assert abs(count / 1e9 - float(published[:-1])) < 10.0 ** -len(published[:-1].split(".")[1])
    with torch.device("meta"):
        assert sum(p.numel() for p in GPT(config).parameters()) == entry["parameters"]


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_preset_shapes_follow_the_published_config(name: str) -> None:
    hf, config = PUBLISHED[name]["config"], ModelConfig.preset(name)
    assert config.n_experts == hf.get("num_experts", hf.get("num_local_experts"))
    assert config.n_experts_per_token == hf["num_experts_per_tok"]
    assert config.expert_hidden == hf.get("moe_intermediate_size", hf["intermediate_size"])
    assert config.moe_renormalize == hf.get("norm_topk_prob", True)  # Mixtral always renormalises
    pairs = {
        "n_embd": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_kv_head": "num_key_value_heads",
        "vocab_size": "vocab_size",
        "block_size": "max_position_embeddings",
        "norm_eps": "rms_norm_eps",
        "rope_theta": "rope_theta",
        "tie_embeddings": "tie_word_embeddings",
    }
    assert {ours: getattr(config, ours) for ours in pairs} == {ours: hf[theirs] for ours, theirs in pairs.items()}


def test_accounting_of_an_moe_model() -> None:
    config = moe_config(moe_shared_hidden=12, moe_shared_gate=True, mlp_bias=True, activation="gelu", moe_layer_step=2)
    with torch.device("meta"):
        model = GPT(config)
    assert param_breakdown(config).total == sum(p.numel() for p in model.parameters())
    expert = sum(
        p[0].numel()
        for p in (
            model.blocks[1].mlp.fc.weight,
            model.blocks[1].mlp.fc.bias,
            model.blocks[1].mlp.proj.weight,
            model.blocks[1].mlp.proj.bias,
        )
    )
    assert active_params(config) == param_breakdown(config).total - (4 - 2) * expert
    dense = ModelConfig.preset("tiny-llama")
    assert active_params(dense) == param_breakdown(dense).total
    # 2 N with N the active parameters (the LM head counted, the untied embedding only looked up) plus attention.
    mixtral = ModelConfig.preset("mixtral-8x7b")
    attention = 4 * mixtral.block_size * mixtral.n_layer * mixtral.n_head * mixtral.head_dim
    embedding = mixtral.vocab_size * mixtral.n_embd
    assert forward_flops_per_token(mixtral) == 2 * (active_params(mixtral) - embedding) + attention


def test_info_gives_total_and_active_parameters() -> None:
    from gptkit.cli.info import describe

    report = describe("olmoe-1b-7b")
    assert (report["total"], report["active"]) == (PUBLISHED["olmoe-1b-7b"]["parameters"], 1282017280)
    assert "64 experts of hidden 1024, top 8, on 16 of 16 layers" in report["switches"]
    # a decoded token streams the active weights but the looked-up (untied) embedding rows: 50,304 x 2,048
    streamed = report["weight_bytes_per_decoded_token"]
    assert streamed["bfloat16"] == 2 * (1282017280 - 50304 * 2048)
    assert streamed["float32"] == 2 * streamed["bfloat16"] and streamed["int4"] == round(streamed["bfloat16"] * 9 / 32)


def test_the_fused_decode_step_covers_moe_models() -> None:
    from gptkit.decoding.fused import uncovered  # (its parity with the eager step: tests/decoding/test_moe_decode.py)

    assert uncovered(tiny_moe_model().eval()) is None


def test_recomputed_blocks_give_the_same_loss_and_gradients() -> None:
    ids, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    grads = []
    for recompute in (False, True):
        model = tiny_moe_model(moe_aux_loss=0.5, moe_z_loss=0.25).train()
        model.checkpoint_blocks = recompute
        loss = model(ids, targets=targets)
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = grads
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # the same operations replayed: measured equal


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_compiled_training_forward_equals_eager(bf16: bool) -> None:
    # torch.compile traces torch._grouped_mm with a shape function that takes bf16 only: fp32 takes the loop.
    ids, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    model = tiny_moe_model(moe_aux_loss=0.1, moe_z_loss=0.01).train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        compiled = torch.compile(model)(ids, targets=targets)
        eager = model(ids, targets=targets)
    compiled.backward()
    # fp32: the same products; bf16: fused kernels round in other places (measured 2e-6 on a loss of 3.6).
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4 if bf16 else 1e-6)
