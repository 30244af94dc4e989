import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, VARIANTS

from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.kv_cache import KVCache
from gptkit.loss import IGNORE_INDEX, next_token_loss
from gptkit.model import GPT, Trace
from gptkit.positions import apply_rope, rope_cos_sin, sinusoidal_embedding


def test_forward_backward_shapes(variant_config, device):
    model = GPT(variant_config).to(device)
    ids = torch.randint(0, variant_config.vocab_size, (3, 11), device=device)
    logits = model(ids)
    assert logits.shape == (3, 11, variant_config.vocab_size)
    loss = next_token_loss(logits[:, :-1], ids[:, 1:])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_causal_future_tokens_never_change_past_logits(variant_config):
    model = GPT(variant_config).eval()
    T = variant_config.block_size
    ids = torch.randint(0, variant_config.vocab_size, (2, T))
    base = model(ids)
    for t in (0, 5, T - 2):
        changed = ids.clone()
        changed[:, t + 1 :] = torch.randint(0, variant_config.vocab_size, (2, T - t - 1))
        assert not torch.equal(changed, ids)
        torch.testing.assert_close(model(changed)[:, : t + 1], base[:, : t + 1], atol=1e-6, rtol=0)
        assert not torch.allclose(model(changed)[:, t + 1 :], base[:, t + 1 :])  # the future did see the change


def test_fast_and_plain_attention_agree(variant_config, device):
    model = GPT(variant_config).eval().to(device)
    ids = torch.randint(0, variant_config.vocab_size, (2, variant_config.block_size), device=device)
    trace = Trace()
    plain = model(ids, trace=trace)
    torch.testing.assert_close(model(ids), plain, atol=1e-5, rtol=1e-5)
    assert len(trace.attentions) == variant_config.n_layer
    for weights in trace.attentions:
        assert weights.shape == (2, variant_config.n_head, 16, 16)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, variant_config.n_head, 16, device=device))
        assert (weights.triu(1) == 0).all()
    extra_final_norm = 1 if variant_config.norm_position == "pre" else 0
    assert len(trace.hidden_states) == 1 + variant_config.n_layer + extra_final_norm


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_attention_in_fp32_under_bf16_autocast(n_kv_head, monkeypatch):
    # The trainer's choice where a CPU's bf16 attention kernel is the slower: the kernel gets fp32 q, k, v even
    # under bf16 autocast, and the block its output back in bf16. Without autocast the switch changes nothing.
    model = GPT(ModelConfig(**dict(TINY, n_kv_head=n_kv_head)))
    ids = torch.randint(0, 50, (2, 16))
    seen, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda q, k, v, **kw: seen.append(q.dtype) or sdpa(q, k, v, **kw)
    )
    outputs, fp32 = {}, {}
    for on in (False, True):
        model.attend_in_fp32(on)
        fp32[on] = model(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs[on] = model(ids)
        assert seen[-model.config.n_layer :] == [torch.float32 if on else torch.bfloat16] * model.config.n_layer
        outputs[on].float().sum().backward()  # gradients flow back through the casts
        assert model.blocks[0].attn.qkv.weight.grad.isfinite().all()
        model.zero_grad()
    # The two differ by where attention's output is rounded to bf16: the bf16 logits (below 1 here, where a bf16
    # step is 2^-8 at most) end at most a step apart (measured over 6 seeds: 2^-8); 2^-7 allows two.
    assert outputs[False].abs().max() < 1
    torch.testing.assert_close(outputs[True], outputs[False], atol=2**-7, rtol=0)
    assert not torch.equal(outputs[True], outputs[False])
    assert torch.equal(fp32[True], fp32[False])


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_grouped_query_attention_shares_kv_heads(n_kv_head):
    config = ModelConfig(**dict(TINY, n_kv_head=n_kv_head, position="rope"))
    model = GPT(config)
    assert model.blocks[0].attn.qkv.out_features == (4 + 2 * n_kv_head) * 8
    assert model(torch.randint(0, 50, (2, 9))).shape == (2, 9, 50)


def test_gqa_equals_multi_head_with_repeated_kv_weights():
    gqa = GPT(ModelConfig(**dict(TINY, n_kv_head=2, position="rope"))).eval()
    mha = GPT(ModelConfig(**dict(TINY, position="rope"))).eval()
    state = gqa.state_dict()
    for i in range(TINY["n_layer"]):
        key = f"blocks.{i}.attn.qkv.weight"
        q, k, v = state[key].split([32, 16, 16])
        # Query heads 0,1 read kv head 0 and heads 2,3 kv head 1: repeat each kv head's rows twice.
        expand = lambda w: w.view(2, 1, 8, 32).expand(2, 2, 8, 32).reshape(32, 32)  # noqa: E731
        state[key] = torch.cat([q, expand(k), expand(v)])
        state[f"blocks.{i}.attn.qkv.bias"] = torch.cat(
            [
                b if j == 0 else b.view(2, 1, 8).expand(2, 2, 8).reshape(32)
                for j, b in enumerate(state[f"blocks.{i}.attn.qkv.bias"].split([32, 16, 16]))
            ]
        )
    mha.load_state_dict(state)
    ids = torch.randint(0, 50, (2, 12))
    torch.testing.assert_close(mha(ids), gqa(ids), atol=1e-5, rtol=1e-5)


def test_tied_weights_are_one_tensor():
    model = GPT(ModelConfig(**TINY))
    assert model.lm_head.weight is model.tok_emb.weight
    untied = GPT(ModelConfig(**dict(TINY, tie_embeddings=False)))
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_ignored_targets_change_neither_loss_nor_gradient():
    model = GPT(ModelConfig(**TINY))
    ids = torch.randint(0, 50, (2, 10))
    targets = torch.randint(0, 50, (2, 10))
    targets[0, 3:6] = IGNORE_INDEX

    def loss_and_grads(tgt):
        model.zero_grad()
        loss = next_token_loss(model(ids), tgt)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_a, grads_a = loss_and_grads(targets)
    other = targets.clone()
    other[0, 3:6] = IGNORE_INDEX  # same mask; the ignored slots held different tokens before masking
    assert torch.equal(other, targets)
    # The mean runs over the 17 valid targets only: equal to the mean of per-position losses there.
    per_position = F.cross_entropy(
        model(ids).reshape(-1, 50), targets.reshape(-1), reduction="none", ignore_index=IGNORE_INDEX
    )
    valid = targets.reshape(-1) != IGNORE_INDEX
    torch.testing.assert_close(loss_a, per_position[valid].sum() / valid.sum())
    # Dropping the ignored positions from the batch entirely gives the same loss and gradient.
    model.zero_grad()
    logits = model(ids)
    keep = targets != IGNORE_INDEX
    loss_b = F.cross_entropy(logits[keep], targets[keep])
    loss_b.backward()
    grads_b = [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(loss_a, loss_b.detach())
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b)


def test_loss_drops_when_overfitting_one_batch(variant_config):
    model = GPT(variant_config)
    ids = torch.randint(0, variant_config.vocab_size, (4, variant_config.block_size + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss = next_token_loss(model(ids[:, :-1]), ids[:, 1:])
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first


def test_gpt2_initialisation_scales_residual_projections():
    config = ModelConfig(**dict(TINY, n_embd=256, n_head=4, n_layer=8))
    model = GPT(config)
    assert abs(model.blocks[0].attn.qkv.weight.std().item() - 0.02) < 0.002
    expected = 0.02 / math.sqrt(2 * 8)
    assert abs(model.blocks[3].attn.proj.weight.std().item() - expected) < 0.1 * expected
    assert abs(model.blocks[3].mlp.proj.weight.std().item() - expected) < 0.1 * expected
    assert (model.blocks[0].attn.qkv.bias == 0).all()
    assert (model.blocks[0].norm1.weight == 1).all()


def test_cached_decode_equals_uncached_forward(variant_config, device):
    model = GPT(variant_config).eval().to(device)
    T = variant_config.block_size
    ids = torch.randint(0, variant_config.vocab_size, (2, T), device=device)
    full = model(ids)
    cache = KVCache(variant_config, batch_size=2, max_len=T, device=device)
    prefill = 5
    steps = [model(ids[:, :prefill], cache=cache, start_pos=0)]
    steps.append(model(ids[:, prefill : prefill + 3], cache=cache, start_pos=prefill))  # a chunk of 3
    for t in range(prefill + 3, T):
        steps.append(model(ids[:, t : t + 1], cache=cache, start_pos=t))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cached_decode_with_per_row_positions(device):
    config = ModelConfig(**VARIANTS["llama-gqa"])
    model = GPT(config).eval().to(device)
    a = torch.randint(0, 50, (1, 12), device=device)
    b = torch.randint(0, 50, (1, 7), device=device)
    cache = KVCache(config, batch_size=2, max_len=16, device=device)
    # Prefill both rows together, right-padded; row b's pad slots get overwritten before they are attended.
    batch = torch.cat([a[:, :6], torch.cat([b[:, :4], torch.zeros(1, 2, dtype=torch.long, device=device)], 1)])
    out = model(batch, cache=cache, start_pos=0)
    torch.testing.assert_close(out[0], model(a[:, :6])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :4], model(b[:, :4])[0], atol=1e-5, rtol=1e-5)
    # Logits at each row's last real token only, as a prefill asks for them.
    last = model(
        batch, cache=KVCache(config, 2, 16, device=device), start_pos=0, logits_at=torch.tensor([5, 3], device=device)
    )
    assert last.shape == (2, 1, 50)
    torch.testing.assert_close(last[:, 0], out[[0, 1], [5, 3]], atol=1e-6, rtol=1e-6)
    pos = torch.tensor([6, 4], device=device)
    for step in range(3):
        step_ids = torch.stack([a[0, 6 + step], b[0, 4 + step]])[:, None]
        logits = model(step_ids, cache=cache, start_pos=pos + step)
        torch.testing.assert_close(logits[0, 0], model(a[:, : 7 + step])[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1, 0], model(b[:, : 5 + step])[0, -1], atol=1e-5, rtol=1e-5)


def test_kv_cache_memory_follows_spec():
    config = ModelConfig(**VARIANTS["llama-gqa"])
    cache = KVCache(config, batch_size=3, max_len=20, dtype=torch.bfloat16)
    assert cache.nbytes == 2 * 2 * 3 * 20 * 2 * 8 * 2


def test_input_errors_are_clear():
    model = GPT(ModelConfig(**TINY))
    with pytest.raises(InputError, match="outside the vocabulary"):
        model(torch.tensor([[1, 50]]))
    with pytest.raises(InputError, match="block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(InputError, match="shape"):
        model(torch.zeros(17, dtype=torch.long))
    with pytest.raises(InputError, match="logits_at"):
        model(torch.zeros(2, 5, dtype=torch.long), logits_at=torch.tensor([4, 5]))
    rope = GPT(ModelConfig(**dict(TINY, position="rope")))
    assert rope(torch.zeros(1, 20, dtype=torch.long)).shape == (1, 20, 50)  # RoPE has no fixed table


def test_sinusoidal_table_matches_formula():
    d = 16
    table = sinusoidal_embedding(torch.arange(50), d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)


def test_rope_rotates_pairs_by_position_angle():
    head_dim, theta = 8, 10000.0
    x = torch.randn(1, 1, 5, head_dim)
    cos, sin = rope_cos_sin(torch.arange(5)[None], head_dim, theta)
    out = apply_rope(x, cos, sin)
    half = head_dim // 2
    for pos in range(5):
        for i in range(half):
            angle = pos * theta ** (-2 * i / head_dim)
            a, b = x[0, 0, pos, i].item(), x[0, 0, pos, i + half].item()
            assert out[0, 0, pos, i].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-5)
            assert out[0, 0, pos, i + half].item() == pytest.approx(b * math.cos(angle) + a * math.sin(angle), abs=1e-5)
    # Relative: q.k after rotation depends only on the distance between positions.
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), head_dim, theta)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), head_dim, theta)
        return (apply_rope(q.view(1, 1, 1, -1), cq, sq) * apply_rope(k.view(1, 1, 1, -1), ck, sk)).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_checkpointed_blocks_give_the_same_loss_and_gradients(variant, device):
    """Activation checkpointing recomputes each block in backward, dropout's random draws included."""
    config = ModelConfig(**{**VARIANTS[variant], "dropout": 0.2})
    ids = torch.randint(0, config.vocab_size, (2, 16), device=device)
    runs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = GPT(config).train().to(device)
        model.checkpoint_blocks = checkpointed
        torch.manual_seed(1)
        loss = model(ids[:, :-1], targets=ids[:, 1:])
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    torch.testing.assert_close(loss_b, loss_a, atol=0, rtol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5)


# The modern small-model recipe (modded-nanogpt's options, qk_norm as Qwen3's) on top of a Llama-style body.
MODERN = dict(
    TINY,
    norm="rmsnorm",
    position="rope",
    activation="relu2",
    n_kv_head=2,
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    tie_embeddings=False,
    qk_norm=True,
    logit_softcap=5.0,
    zero_init_proj=True,
    vocab_multiple=16,
)


def test_qk_norm_normalises_each_heads_q_and_k_over_head_dim_before_rope():
    config = ModelConfig(**dict(TINY, n_layer=1, norm="rmsnorm", position="rope", n_kv_head=2, qk_norm=True))
    model = GPT(config).eval()
    attn, hd, T = model.blocks[0].attn, config.head_dim, 7
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (hd,)  # one gain each, shared by the heads
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.uniform_(0.5, 2.0)
        ids = torch.randint(0, config.vocab_size, (1, T))
        trace = Trace()
        model(ids, trace=trace)
        qkv = attn.qkv(model.blocks[0].norm1(model.tok_emb(ids)[0]))  # (T, (H + 2 KV) hd)
        head, kv_head = 3, 1  # query head 3 reads key head 3 // (4 / 2)
        q = qkv[:, head * hd : (head + 1) * hd]
        k = qkv[:, config.n_embd + kv_head * hd : config.n_embd + (kv_head + 1) * hd]
        normed = [
            v / torch.sqrt((v * v).mean(-1, keepdim=True) + config.norm_eps) * g
            for v, g in ((q, attn.q_norm.weight), (k, attn.k_norm.weight))
        ]
        cos, sin = rope_cos_sin(torch.arange(T)[None], hd, config.rope_theta)
        q, k = (apply_rope(v[None, None], cos, sin)[0, 0] for v in normed)  # RoPE after the norm
        scores = (q @ k.T / math.sqrt(hd)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(trace.attentions[0][0, head], scores.softmax(-1), atol=1e-6, rtol=1e-5)


def test_relu2_feed_forward_squares_relu():
    mlp = GPT(ModelConfig(**dict(TINY, activation="relu2"))).blocks[0].mlp
    assert mlp.fc.weight.shape == (4 * 32, 32)  # one input projection: not gated
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(mlp(x), mlp.proj(torch.clamp(mlp.fc(x), min=0) ** 2), atol=0, rtol=0)


def test_logit_softcap_gives_c_tanh_z_over_c_on_every_logit_path():
    c, T = 0.5, 12
    raw = GPT(ModelConfig(**TINY)).eval()
    with torch.no_grad():
        raw.norm_f.weight.mul_(30.0)  # logits well past the cap
    capped = GPT(ModelConfig(**dict(TINY, logit_softcap=c))).eval()
    capped.load_state_dict(raw.state_dict())
    ids = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        z = raw(ids)
        want = c * torch.tanh(z / c)
        assert z.abs().max() > 2 * c
        torch.testing.assert_close(capped(ids), want, atol=1e-6, rtol=1e-6)
        at = torch.tensor([3, 11])
        torch.testing.assert_close(capped(ids, logits_at=at), want[torch.arange(2), at][:, None], atol=1e-6, rtol=0)
        cache = KVCache(capped.config, batch_size=2, max_len=T)
        steps = [capped(ids[:, :5], cache=cache)] + [
            capped(ids[:, t : t + 1], cache=cache, start_pos=t) for t in range(5, T)
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), want, atol=1e-5, rtol=1e-5)
        loss = capped(ids[:, :-1], targets=ids[:, 1:])
    torch.testing.assert_close(loss, next_token_loss(want[:, :-1], ids[:, 1:]), atol=1e-6, rtol=1e-6)


def test_zero_init_proj_starts_every_block_as_the_identity():
    model = GPT(ModelConfig(**dict(TINY, zero_init_proj=True))).eval()
    for block in model.blocks:
        assert not block.attn.proj.weight.any() and not block.mlp.proj.weight.any()
        assert block.attn.qkv.weight.std() > 0.01 and block.mlp.fc.weight.std() > 0.01  # the rest as GPT-2's
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        embedded = model.tok_emb(ids) + model.pos_emb(torch.arange(9))
        torch.testing.assert_close(model(ids), model.lm_head(model.norm_f(embedded)), atol=0, rtol=0)


def padded_copy(model: GPT, vocab_multiple: int) -> GPT:
    """model with its vocabulary padded to vocab_multiple: the same real rows, and padded head rows in pairs v, -v
    of large random directions (and a large bias), so that some padded logit is the largest wherever it is seen."""
    config = model.config
    padded = GPT(ModelConfig(**dict(config.to_dict(), vocab_multiple=vocab_multiple))).eval()
    real = model.state_dict()
    with torch.no_grad():
        for name, tensor in padded.state_dict().items():
            tensor.fill_(100.0)
            tensor[: real[name].size(0)] = real[name]
        extra = padded.config.padded_vocab_size - config.vocab_size
        directions = torch.randn(extra // 2 + 1, config.n_embd)
        padded.lm_head.weight[config.vocab_size :] = 100.0 * torch.cat([directions, -directions])[:extra]
        leaked = padded.lm_head(padded.hidden(torch.arange(config.vocab_size)[:, None]))  # (V, 1, padded V)
        assert bool((leaked.argmax(-1) >= config.vocab_size).all())
    return padded


@pytest.mark.parametrize("head", ["tied", "untied with bias"])
def test_a_padded_vocabulary_changes_no_logit_and_no_loss(head):
    extra = {} if head == "tied" else dict(tie_embeddings=False, lm_head_bias=True)
    plain = GPT(ModelConfig(**dict(TINY, **extra))).eval()
    padded = padded_copy(plain, 16)
    assert padded.config.padded_vocab_size == 64 and padded.lm_head.weight.shape == (64, 32)
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        logits = padded(ids)
        assert logits.shape == (2, 12, 50)  # the padded columns never leave the model
        torch.testing.assert_close(logits, plain(ids), atol=1e-6, rtol=0)
        at = torch.tensor([4, 0])
        torch.testing.assert_close(padded(ids, logits_at=at), plain(ids, logits_at=at), atol=1e-6, rtol=0)
        torch.testing.assert_close(padded(ids, targets=ids), plain(ids, targets=ids), atol=1e-6, rtol=0)
    with pytest.raises(InputError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        padded(torch.tensor([[1, 50]]))


def test_every_recipe_option_at_once_trains(device):
    """Forward and backward of a model with every option on: finite gradients everywhere, exactly zero on the
    padded rows, and the zero projections are the first to move (the blocks train from the identity)."""
    config = ModelConfig(**MODERN)
    model = GPT(config).to(device)
    ids = torch.randint(0, config.vocab_size, (2, 12), device=device)
    logits = model(ids)
    assert logits.shape == (2, 12, config.vocab_size) and logits.abs().max() < config.logit_softcap
    loss = model(ids[:, :-1], targets=ids[:, 1:])
    torch.testing.assert_close(loss, next_token_loss(logits[:, :-1], ids[:, 1:]), atol=1e-5, rtol=1e-5)
    loss.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    for weight in (model.tok_emb.weight, model.lm_head.weight):
        assert weight.shape[0] == 64 and not weight.grad[config.vocab_size :].any()
    assert model.blocks[-1].mlp.proj.weight.grad.abs().sum() > 0
