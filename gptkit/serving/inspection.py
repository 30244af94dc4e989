"""What the playground shows about a text: one layer's attention map, each token's probability, the logit lens at
each position and the model's induction heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptkit.model import GPT
from gptkit.observe.measures import chance_induction_score, induction_test, logit_lens_top
from gptkit.observe.prompt import attention_maps, prompt_insight, state_labels, token_probabilities

DIGITS = 4  # probabilities, scores and losses are rounded to this many decimals (small payloads)


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


@dataclass(frozen=True)
class LensPosition:
    """The logit lens at one position: per layer (embedding, layer 0..n-1) its top tokens and the probability it
    gives the model's final prediction, and the first layer whose top token is that prediction."""

    position: int  # index of the token in the text; the lens reads what the model predicts after it
    token: int
    prediction: int  # the model's own (greedy) next token: the last layer's top token
    top: list[list[tuple[int, float]]]  # per layer, (token, probability) best first
    prediction_probs: list[float]  # per layer, the probability of `prediction`
    decided_at: int  # the first layer (0: the embedding) whose top token is `prediction`


def lens_window(ids: list[int], block_size: int, position: int | None) -> tuple[int, list[int]]:
    """Where the tokens the lens reads start in ids, and those tokens: the block_size tokens ending at position
    (default: the last block_size tokens), as a model with learned positions cannot read more."""
    end = len(ids) if position is None else position + 1
    start = max(0, end - block_size)
    return start, ids[start:end]


def lens_positions(model: GPT, ids: list[int], position: int | None = None, top: int = 1) -> list[LensPosition]:
    """The logit lens at each position of ids (or at `position` only), top tokens per layer."""
    start, window = lens_window(ids, model.config.block_size, position)
    lens = logit_lens_top(model, window, top)  # per stage (n_layer + 1) and position, reduced stage by stage
    tokens, values = lens.tokens, lens.probs  # (n_layer + 1, T, top)
    prediction = tokens[-1, :, 0]  # (T,): the last layer reads the model's own distribution
    decided = (tokens[:, :, 0] == prediction).int().argmax(dim=0)  # first True; the last layer always is
    rows = range(len(window)) if position is None else [len(window) - 1]
    return [
        LensPosition(
            position=start + t,
            token=window[t],
            prediction=int(prediction[t]),
            top=[list(zip(tokens[k, t].tolist(), values[k, t].tolist())) for k in range(tokens.size(0))],
            prediction_probs=lens.prediction_probs[:, t].tolist(),
            decided_at=int(decided[t]),
        )
        for t in rows
    ]


def lens_labels(model: GPT) -> list[str]:
    """The names of the lens's layers: "embedding", "layer 0" .. "layer n-1" (numbered from 0, as everywhere)."""
    return state_labels(model.config)[: model.config.n_layer + 1]


def induction_summary(model: GPT) -> dict[str, Any]:
    """The induction test on model as the playground shows it: per-head scores, both half losses, the chance
    level and the strongest head, rounded."""
    result = induction_test(model)
    scores = result.scores
    best = int(scores.argmax())
    layer, head = divmod(best, scores.size(1))
    return {
        "layers": scores.size(0),
        "heads": scores.size(1),
        "scores": [[round(s, DIGITS) for s in row] for row in scores.tolist()],
        "first_half_loss": round(result.first_half_loss, DIGITS),
        "repeated_half_loss": round(result.repeated_half_loss, DIGITS),
        "length": result.length,
        "chance": round(chance_induction_score(result.length), DIGITS),
        "strongest": {"layer": layer, "head": head, "score": round(float(scores[layer, head]), DIGITS)},
    }
