"""docs/spec.md section 3.2's worked numbers, computed through gptkit's own functions."""

import torch

from gptkit.attention import plain_attention
from gptkit.loss import next_token_loss


def test_cross_entropy_worked_number():
    # vocabulary {a, b, c, d}; sequence [a, b, c, a]; rows predict b, c, a.
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.3], [0.5, 3.0, 1.0, 0.2], [0.3, 0.8, 2.5, 1.0]])
    targets = torch.tensor([1, 2, 0])
    loss = next_token_loss(logits[None], targets[None])
    assert round(loss.item(), 4) == 2.1450


def test_causal_attention_worked_rows():
    scores = torch.tensor([[2.0, 1.0, 0.5, -0.3], [1.5, 3.0, 1.2, 0.1], [0.8, 2.0, 2.5, 1.0], [0.2, 0.5, 1.8, 3.0]])
    # plain_attention scales by 1/sqrt(d_k): feed q = scores * sqrt(d_k) rows against k = identity.
    d_k = 4
    q = (scores * d_k**0.5)[None, None]
    k = torch.eye(4)[None, None]
    v = torch.eye(4)[None, None]
    _, weights = plain_attention(q, k, v, mask=None, dropout=0.0)
    expected = torch.tensor(
        [
            [1.0, 0, 0, 0],
            [0.1824, 0.8176, 0, 0],
            [0.1021, 0.3390, 0.5589, 0],
            [0.0421, 0.0568, 0.2086, 0.6925],
        ]
    )
    torch.testing.assert_close(weights[0, 0], expected, atol=5e-5, rtol=0)
    assert (weights[0, 0].triu(1) == 0).all()
