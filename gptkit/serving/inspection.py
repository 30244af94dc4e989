"""What the playground shows about a text: one layer's attention map and each token's probability."""

from __future__ import annotations

from gptkit.insight import attention_maps, prompt_insight, token_probabilities
from gptkit.model import GPT


def attention_map(
    model: GPT, ids: list[int], layer: int, head: int | None
) -> tuple[list[list[float]], list[float | None]]:
    """Attention weights (T, T) of one layer (one head, or averaged over heads) and p(token | tokens before it).

    The first token has no probability (nothing predicts it), hence None.
    """
    insight = prompt_insight(model, ids)
    weights = attention_maps(insight)[layer]  # (n_head, T, T)
    weights = weights.mean(dim=0) if head is None else weights[head]
    probs = token_probabilities(insight.logits, insight.ids)
    return weights.tolist(), [None, *probs.tolist()]
