"""The optimisers: Muon on the blocks' matrices beside AdamW (its update, its groups, against torch.optim directly),
and the warm-up / stable / decay schedule."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gptkit import optim
from gptkit.adapters import add_lora
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.model import GPT
from gptkit.optim import (
    NS_COEFFICIENTS,
    MuonAdamW,
    block_matrices,
    iterate_on_gram,
    lr_at,
    make_optimizer,
    newton_schulz_dtype,
    orthogonalise,
    orthogonalise_batch,
    param_groups,
    same_shape_batches,
    set_learning_rates,
)
from gptkit.train_config import OptimConfig

TINY = ModelConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, n_embd=16)


def newton_schulz_by_hand(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration X <- aX + (bA + cA^2)X, A = XX^T, from X = G/||G||_F, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


@pytest.mark.parametrize("ns_dtype, tolerance", [("float32", 1e-5), ("bfloat16", 0.06)])
def test_one_muon_step_is_the_hand_computation(ns_dtype, tolerance):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    start = weight.detach().clone()
    grad = torch.randn(6, 4)
    lr, decay, momentum = 0.02, 0.1, 0.95
    weight.grad = grad.clone()
    config = OptimConfig(name="muon", muon_lr=lr, muon_weight_decay=decay, muon_momentum=momentum)
    optimizer = MuonAdamW([weight], [], config)
    optimizer.param_groups[0]["ns_dtype"] = ns_dtype
    optimizer.step()
    # First step: the momentum buffer is an average, B = (1 - mu) g; Nesterov looks ahead to (1 - mu) g + mu B. The
    # update is scaled by sqrt(max(1, rows / cols)) (Keller Jordan's shape rule) after decoupled weight decay.
    buffer = (1 - momentum) * grad
    ortho = newton_schulz_by_hand((1 - momentum) * grad + momentum * buffer)
    expected = start * (1 - lr * decay) - lr * math.sqrt(6 / 4) * ortho
    # The O(1) entries of the orthogonalised update agree with float64's to `tolerance`: in float32 to rounding
    # (measured: at most 2e-6); in bfloat16 (8 significant bits, five rounds of three products) up to 0.051
    # (measured over 200 random 6 x 4 gradients, PyTorch's own bf16 iteration alike).
    torch.testing.assert_close(weight.detach(), expected, atol=lr * math.sqrt(6 / 4) * tolerance, rtol=0)
    # The orthogonalised update's singular values sit near 1 (the quintic's band is about 0.7 to 1.2).
    singular = torch.linalg.svdvals(ortho)
    assert singular.min() > 0.5 and singular.max() < 1.3
    torch.testing.assert_close(optimizer.state[weight]["momentum_buffer"], buffer, atol=0, rtol=1e-6)


def test_orthogonalise_in_bfloat16_is_pytorchs_newton_schulz_bit_for_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz

    for shape in ((6, 4), (4, 6), (16, 16), (8, 32), (32, 8)):  # (a wide one: float32 alone iterates on its Gram)
        update = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        ours = orthogonalise(update, 5, torch.bfloat16)
        assert torch.equal(ours, _zeropower_via_newtonschulz(update, (3.4445, -4.7750, 2.0315), 5, 1e-7))


@pytest.mark.parametrize(
    "shape, on_gram",
    [((8, 32), True), ((32, 8), True), ((3, 8, 32), True), ((8, 12), False), ((12, 8), False), ((16, 16), False)],
)
def test_float32_iterates_on_the_gram_matrix_where_that_is_cheaper_and_agrees_with_float64(shape, on_gram, monkeypatch):
    # Past 1.5 columns a row (of the wide side) the rounds run on r x r products: the same iteration, fewer FLOPs.
    calls = []
    monkeypatch.setattr(optim, "iterate_on_gram", lambda *args: calls.append(1) or iterate_on_gram(*args))
    update = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    ours = orthogonalise(update, 5, torch.float32)
    assert len(calls) == on_gram
    expected = torch.stack([newton_schulz_by_hand(u) for u in update.reshape(-1, *shape[-2:])]).reshape(shape)
    # O(1) entries, float32 rounding through five rounds (measured at most 1.2e-6 on either path, over these shapes,
    # 16 x 48 and 128 x 512, five seeds each; 5e-6 leaves room for another BLAS's order of summation).
    torch.testing.assert_close(ours, expected, atol=5e-6, rtol=0)


@pytest.mark.parametrize("steps", [5, 10, 20])
def test_the_gram_iteration_stays_bounded_for_a_low_rank_update_at_any_number_of_rounds(steps):
    # Carried along without a rebuild, A's rounding grew about 11.9x a round in the directions X lacks: a rank-30
    # update went to 3e10 in 10 rounds and NaN in 12. Rebuilt every GRAM_ROUNDS rounds, its singular values stay in
    # the quintic's band (at most about 1.2), as the rounds as written keep them.
    generator = torch.Generator().manual_seed(0)
    update = torch.randn(128, 30, generator=generator) @ torch.randn(30, 512, generator=generator)
    ours = orthogonalise(update, steps, torch.float32)
    assert ours.isfinite().all() and torch.linalg.svdvals(ours).max() < 1.3
    assert torch.linalg.svdvals(ours)[:30].min() > 0.6  # its 30 directions orthogonalised


def test_a_dtensor_shard_takes_the_rounds_as_written(monkeypatch):
    # FSDP2 hands Muon row-sharded DTensors: their products gather what they need, but the Gram iteration's in-place
    # add to a diagonal would count once per rank of a partial sum (a two-process float32 run went non-finite).
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        update = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        shard = distribute_tensor(update, init_device_mesh("cpu", (1,)), [Shard(0)])
        calls = []
        monkeypatch.setattr(optim, "iterate_on_gram", lambda *args: calls.append(1) or iterate_on_gram(*args))
        ours = orthogonalise(shard, 5, torch.float32).full_tensor()
        assert calls == []
        torch.testing.assert_close(ours, orthogonalise(update, 5, torch.float32), atol=2e-6, rtol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "fma"}, "float32"),
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "amx_bf16"}, "bfloat16"),
    ],
)
def test_the_newton_schulz_dtype_is_bfloat16_on_a_gpu_or_bf16_hardware_and_float32_elsewhere(
    monkeypatch, flags, expected
):
    from gptkit.native import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    assert newton_schulz_dtype(torch.device("cpu")) == expected
    assert newton_schulz_dtype(torch.device("cuda")) == "bfloat16"
    optimizer, _ = make_optimizer(GPT(TINY), OptimConfig(name="muon"))
    assert {g["ns_dtype"] for g in optimizer.param_groups if g["optimizer"] == "muon"} == {expected}


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = GPT(TINY)
    optimizer, fused = make_optimizer(model, OptimConfig(name="muon", weight_decay=0.1))
    assert isinstance(optimizer, MuonAdamW) and not fused
    names = {p: n for n, p in model.named_parameters()}
    muon = [names[p] for g in optimizer.param_groups if g["optimizer"] == "muon" for p in g["params"]]
    assert sorted(muon) == sorted(
        f"blocks.{i}.{layer}.weight" for i in range(2) for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    )
    adamw = {
        names[p]: g["weight_decay"] for g in optimizer.param_groups if g["optimizer"] == "adamw" for p in g["params"]
    }
    assert adamw["tok_emb.weight"] == adamw["pos_emb.weight"] == 0.1  # the tied LM head is the token embedding
    assert adamw["blocks.0.attn.qkv.bias"] == adamw["norm_f.weight"] == 0.0
    assert len(muon) + len(adamw) == len(list(model.parameters()))  # every parameter exactly once


def test_muon_adamw_steps_as_torch_muon_and_adamw_side_by_side():
    torch.manual_seed(0)
    ours, reference = GPT(TINY), GPT(TINY)
    reference.load_state_dict(ours.state_dict())
    config = OptimConfig(name="muon", lr=3e-3, muon_lr=0.03, muon_weight_decay=0.01)
    combined, _ = make_optimizer(ours, config)
    for group in combined.param_groups:  # PyTorch's Muon iterates in bfloat16 only
        group["ns_dtype"] = "bfloat16"
    matrices = block_matrices(reference)
    muon = torch.optim.Muon(matrices, lr=0.03, weight_decay=0.01, momentum=0.95, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(
        param_groups(reference, config.weight_decay, exclude=set(matrices)), lr=3e-3, betas=(0.9, 0.95), fused=True
    )
    ids = torch.randint(0, 50, (3, 2, 8))
    bound = 0.0
    for step in range(3):
        lr = set_learning_rates(combined, step, config, max_steps=3)
        muon_lr = 0.03 * lr / 3e-3  # muon_lr follows lr's schedule
        bound += muon_lr * math.sqrt(3) * 2**-8  # see below
        for group in muon.param_groups:
            group["lr"] = muon_lr
        for group in adamw.param_groups:
            group["lr"] = lr
        for model in (ours, reference):
            model(ids[step], targets=ids[step]).backward()
        combined.step()
        muon.step()
        adamw.step()
        combined.zero_grad()
        muon.zero_grad()
        adamw.zero_grad()
    # Ours orthogonalises the two layers' same-shape matrices as one batch and PyTorch's each alone: on the AMD
    # reference machine the bf16 products round alike and the weights are equal bit for bit. Where a batched kernel
    # rounds otherwise, an update differs by at most a bf16 unit in the last place of its O(1) entries (2^-8) times
    # Muon's lr (in warm-up here) x sqrt(3) (the tallest shape's scale), summed over the steps: `bound`, 1.2e-5.
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=bound, rtol=0, msg=name)


@pytest.mark.parametrize(
    "limit, batches",
    [(None, [[0, 1, 2], [3, 5], [4]]), (2 * 48 * 16, [[0, 1], [2], [3, 5], [4]]), (1, [[0], [1], [2], [3], [5], [4]])],
)
def test_same_shape_matrices_batch_together_within_the_entry_limit(limit, batches, monkeypatch):
    if limit is not None:
        monkeypatch.setattr(optim, "MAX_BATCH_ELEMENTS", limit)
    shapes = ((48, 16), (16, 48), (48, 16), (16, 16), (8, 4), (16, 16))
    assert same_shape_batches([torch.zeros(shape) for shape in shapes]) == batches
    assert same_shape_batches([torch.zeros(16, 16), torch.zeros(16, 16, dtype=torch.bfloat16)]) == [[0], [1]]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 2**-8)])
def test_orthogonalising_a_batch_of_same_shape_matrices_is_orthogonalising_each_alone(dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(shape, generator=generator) for shape in ((48, 16), (16, 48), (48, 16))]
    updates.append(updates[0].clone())
    batched = orthogonalise_batch(updates, 5, dtype, NS_COEFFICIENTS, 1e-7)
    # Measured: at most 9e-7 apart in float32 (a tall matrix iterates on its transpose's layout), bit for bit in
    # bfloat16 on the AMD reference machine; at most one bf16 unit in the last place of an O(1) entry elsewhere.
    for update, together in zip(updates, batched):
        assert together.shape == update.shape and together.dtype == dtype
        torch.testing.assert_close(together, orthogonalise(update, 5, dtype), atol=tolerance, rtol=0)
    assert torch.equal(batched[0], batched[3])  # the same update in one batch gives the same result


def test_under_muon_lora_adapters_train_with_adamw_and_the_frozen_base_is_left_out():
    model = add_lora(GPT(TINY), rank=2, alpha=4.0, dropout=0.0, targets="all")
    assert block_matrices(model) == []
    optimizer, _ = make_optimizer(model, OptimConfig(name="muon"))
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    assert {g["optimizer"] for g in optimizer.param_groups} == {"adamw"}
    assert len(trained) == len([p for p in model.parameters() if p.requires_grad]) == 2 * 2 * 4  # A and B, 8 layers


def test_muon_state_round_trips_through_load_state_dict():
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer, _ = make_optimizer(model, OptimConfig(name="muon"))
    ids = torch.randint(0, 50, (2, 8))
    model(ids, targets=ids).backward()
    optimizer.step()
    optimizer.zero_grad()
    saved = copy.deepcopy(optimizer.state_dict())
    twin = GPT(TINY)
    twin.load_state_dict(model.state_dict())
    fresh, _ = make_optimizer(twin, OptimConfig(name="muon"))
    fresh.load_state_dict(saved)
    muon, adamw = fresh.inner
    # The inner optimisers step the loaded groups and state (load_state_dict replaced both).
    assert muon.param_groups and all(any(g is mine for mine in fresh.param_groups) for g in muon.param_groups)
    assert muon.state is fresh.state and adamw.state is fresh.state
    for one in (model, twin):
        one(ids, targets=ids).backward()
    optimizer.step()
    fresh.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name  # the second step of each continues from the same momentum and moments


def test_lora_under_either_optimizer_resumes_the_others_groups():
    model = add_lora(GPT(TINY), rank=2, alpha=4.0, dropout=0.0, targets="all")
    under_adamw, _ = make_optimizer(model, OptimConfig(name="adamw"))
    under_muon, _ = make_optimizer(model, OptimConfig(name="muon"))
    assert [len(g["params"]) for g in under_muon.param_groups] == [len(g["params"]) for g in under_adamw.param_groups]
    under_muon.load_state_dict(under_adamw.state_dict())  # no "different number of parameter groups"


def test_wsd_schedule_holds_then_cools_down_linearly():
    o = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="wsd", cooldown_fraction=0.2)
    assert lr_at(4, o, 100) == pytest.approx(1e-3 * 5 / 11)
    assert lr_at(10, o, 100) == lr_at(79, o, 100) == 1e-3  # stable until the last 20 steps
    assert lr_at(80, o, 100) == 1e-3
    assert lr_at(90, o, 100) == pytest.approx(1e-3 + 0.5 * (1e-4 - 1e-3))
    assert lr_at(100, o, 100) == 1e-4
    # Muon's groups follow the same curve from muon_lr.
    model = GPT(TINY)
    optimizer, _ = make_optimizer(model, OptimConfig(name="muon", lr=1e-3, muon_lr=0.02, schedule="wsd"))
    set_learning_rates(
        optimizer,
        90,
        OptimConfig(
            name="muon", lr=1e-3, min_lr=1e-4, muon_lr=0.02, schedule="wsd", cooldown_fraction=0.2, warmup_steps=10
        ),
        100,
    )
    lrs = {g["optimizer"]: g["lr"] for g in optimizer.param_groups}
    assert lrs["adamw"] == pytest.approx(5.5e-4) and lrs["muon"] == pytest.approx(0.02 * 0.55)


@pytest.mark.parametrize(
    "field, value",
    [
        ("muon_lr", 0.0),
        ("muon_momentum", 1.0),
        ("cooldown_fraction", 1.5),
        ("muon_weight_decay", -0.1),
        ("muon_ns_steps", 0),
    ],
)
def test_muon_settings_out_of_range_name_the_setting(field, value):
    with pytest.raises(ConfigError, match=f"optim.{field}"):
        OptimConfig(name="muon", **{field: value}).validate()


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_the_plans_muon_state_counts_the_matrices_muon_takes(preset):
    from gptkit.plan import block_matrix_params

    config = ModelConfig.preset(preset)
    assert block_matrix_params(config) == sum(p.numel() for p in block_matrices(GPT(config)))
