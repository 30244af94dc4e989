"""The LM head fused into the loss (model(ids, targets=...)) against logits + F.cross_entropy, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import VARIANTS

from gptkit import loss as loss_module
from gptkit.config import ModelConfig
from gptkit.loss import IGNORE_INDEX, linear_cross_entropy, next_token_loss
from gptkit.model import GPT


def _inputs(bias: bool, device: torch.device | str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=gen).to(device).requires_grad_()
    weight = torch.randn(13, 8, generator=gen).to(device).requires_grad_()
    b = torch.randn(13, generator=gen).to(device).requires_grad_() if bias else None
    targets = torch.randint(0, 13, (3, 5), generator=gen)
    targets[1, 2:4] = IGNORE_INDEX
    return hidden, weight, b, targets.to(device)


def _slice(monkeypatch, logits: int) -> None:
    """Slices of this many logits on every device."""
    monkeypatch.setattr(loss_module, "SLICE_LOGITS", logits)
    monkeypatch.setattr(loss_module, "GPU_SLICE_LOGITS", logits)


@pytest.mark.parametrize("slice_logits", [2**25, 13 * 4, 1])  # plain path, slices of 4 rows, one row at a time
@pytest.mark.parametrize("bias", [False, True])
def test_fused_loss_and_gradients_equal_the_plain_ones(monkeypatch, slice_logits, bias, device):
    _slice(monkeypatch, slice_logits)
    hidden, weight, b, targets = _inputs(bias, device)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    fused = linear_cross_entropy(hidden, weight, b, targets)
    plain = next_token_loss(F.linear(hidden, weight, b), targets)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(3 * fused, inputs), torch.autograd.grad(3 * plain, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("slice_logits", [2**25, 13 * 4])
def test_fused_loss_without_autograd_and_with_every_target_ignored(monkeypatch, slice_logits):
    _slice(monkeypatch, slice_logits)
    hidden, weight, _, targets = _inputs(False)
    with torch.no_grad():
        value = linear_cross_entropy(hidden, weight, None, targets)
    assert value.grad_fn is None
    torch.testing.assert_close(value, next_token_loss(F.linear(hidden, weight), targets).detach())
    ignored = torch.full_like(targets, IGNORE_INDEX)  # as F.cross_entropy: 0 / 0
    assert torch.isnan(linear_cross_entropy(hidden, weight, None, ignored))


def test_model_with_targets_returns_the_loss_of_its_logits(variant_config, monkeypatch, device):
    _slice(monkeypatch, 5 * variant_config.vocab_size)  # slices of 5 rows
    torch.manual_seed(0)
    model = GPT(variant_config).to(device)
    ids = torch.randint(0, variant_config.vocab_size, (2, 9), device=device)
    targets = torch.randint(0, variant_config.vocab_size, (2, 9), device=device)
    targets[0, :3] = IGNORE_INDEX
    params = [p for p in model.parameters()]
    fused = model(ids, targets=targets)
    grads = torch.autograd.grad(fused, params)
    plain = next_token_loss(model(ids), targets)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, torch.autograd.grad(plain, params)):  # a tied head gets both of its gradients
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# Own head with a bias by default; the tied head compiled (a compile each, ~14 s) is slow: its sliced loss is the
# same code, and compiled training of a tied model runs by default (tests/train/test_train.py, compiled_training).
@pytest.mark.parametrize("variant", [pytest.param("gpt2", marks=pytest.mark.slow), "untied-head-bias"])
def test_compiled_model_with_targets_matches_eager(variant, monkeypatch):
    config = ModelConfig(**VARIANTS[variant])
    monkeypatch.setattr(loss_module, "SLICE_LOGITS", 5 * config.vocab_size)  # slices of 5 rows
    torch.manual_seed(0)
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    targets = torch.randint(0, config.vocab_size, (2, 9))
    eager = model(ids, targets=targets)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()))
    compiled = torch.compile(model)(ids, targets=targets)
    compiled_grads = torch.autograd.grad(compiled, list(model.parameters()))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_targets_of_another_shape_are_a_clear_error():
    from gptkit.errors import InputError

    model = GPT(ModelConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(InputError, match="targets must have the shape of ids"):
        model(ids, targets=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InputError, match="without logits_at"):
        model(ids, targets=ids, logits_at=torch.tensor([3, 3]))


def test_a_second_backward_through_the_sliced_loss_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(loss_module, "SLICE_LOGITS", 13 * 4)
    hidden, weight, _, targets = _inputs(False)
    value = linear_cross_entropy(hidden, weight, None, targets)
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        value.backward()


@pytest.mark.parametrize("slice_logits", [2**25, 16 * 4])  # plain path; slices of 4 rows of the padded head
@pytest.mark.parametrize("softcap, vocab", [(3.0, 16), (None, 13), (2.0, 13)])  # capped; padded; both
def test_fused_loss_with_softcap_and_padding_equals_autograd_of_the_plain_formula(
    monkeypatch, slice_logits, softcap, vocab, device
):
    """The loss of c * tanh(z / c) over the first 13 of 16 head rows: its gradient takes the factor 1 - tanh^2, and
    the 3 padded rows (weight and bias) get a gradient of exactly zero."""
    _slice(monkeypatch, slice_logits)
    hidden, _, _, targets = _inputs(False, device)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 8, generator=gen).to(device).requires_grad_()
    b = torch.randn(16, generator=gen).to(device).requires_grad_()
    fused = linear_cross_entropy(hidden, weight, b, targets, softcap=softcap, vocab_size=vocab)
    z = F.linear(hidden, weight, b)[..., :vocab]
    plain = next_token_loss(z if softcap is None else softcap * torch.tanh(z / softcap), targets)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    got, want = torch.autograd.grad(3 * fused, [hidden, weight, b]), torch.autograd.grad(3 * plain, [hidden, weight, b])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert not got[1][vocab:].any() and not got[2][vocab:].any()  # exactly zero: the padded rows never counted
    if softcap is not None:  # the cap did change the loss (its scale is near the logits')
        assert abs(float(fused.detach()) - float(next_token_loss(z, targets).detach())) > 1e-3


def test_row_logprobs_per_token_summed_and_averaged_against_a_hand_computation():
    from gptkit.loss import row_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, IGNORE_INDEX, 4], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    logp = logits.log_softmax(-1)
    per_token = row_logprobs(logits, targets, "none")
    torch.testing.assert_close(per_token[0], torch.stack([logp[0, 0, 1], torch.tensor(0.0), logp[0, 2, 4]]))
    assert per_token[1].abs().sum() == 0  # a row of ignored targets counts nothing
    torch.testing.assert_close(
        row_logprobs(logits, targets, "sum"), torch.stack([logp[0, 0, 1] + logp[0, 2, 4], torch.tensor(0.0)])
    )
    torch.testing.assert_close(
        row_logprobs(logits, targets, "mean"), torch.stack([(logp[0, 0, 1] + logp[0, 2, 4]) / 2, torch.tensor(0.0)])
    )
