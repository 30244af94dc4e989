"""`gptkit inspect`'s report: every picture of a prompt's pass through a model saved as a PNG, and an index.html
that shows them with captions."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from gptkit.accounting import param_breakdown
from gptkit.atomic import atomic_write_text
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.model import GPT
from gptkit.moe import moe_layers
from gptkit.observe import measures
from gptkit.observe.ablation import ablation_study
from gptkit.observe.figures import (
    TOP_TOKENS,
    draw_activation,
    draw_attention,
    draw_distributions,
    draw_head_contributions,
    draw_icl,
    draw_induction,
    draw_logit_lens,
    draw_mask,
    draw_norms,
    draw_parameters,
    draw_similarity,
    save_png,
)
from gptkit.observe.prompt import (
    MAX_HEATMAP_TOKENS,
    TEMPERATURES,
    PromptInsight,
    attention_maps,
    default_icl_prompt,
    hidden_state_norms,
    layer_similarity,
    lens_rows,
    next_token_distributions,
    prompt_insight,
    token_labels,
)
from gptkit.observe.routing import draw_routing, routing_of, specialisation, token_kinds
from gptkit.tokenizer import Tokenizer


@dataclass(frozen=True)
class Picture:
    """A written PNG and what index.html says about it."""

    file: str
    title: str
    caption: str
    data: str | None = None  # a JSON file beside the PNG holding the numbers drawn


# A picture before it is written: (figure, file name, heading, caption[, the numbers drawn]).
Drawn = tuple[Figure, str, str, str] | tuple[Figure, str, str, str, dict]


def write_report(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    out_dir: str | Path,
    title: str = "model",
    max_tokens: int = MAX_HEATMAP_TOKENS,
    icl_prompt: str | None = None,
    data_tokens: np.ndarray | None = None,
) -> list[Picture]:
    """Write every picture of the prompt's pass through model into out_dir, then index.html showing them.

    Heatmaps over positions draw at most the last max_tokens positions (the captions say so). icl_prompt is the
    few-shot prompt of the ICL picture (default: one built from prompt); data_tokens, running text such as a
    val.bin, gives its loss-along-the-context curve (default: the few-shot prompt's own losses).
    """
    if max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, got {max_tokens}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory for the report")
    out.mkdir(parents=True, exist_ok=True)
    insight = prompt_insight(model, tokenizer.encode(prompt))
    shown = min(len(insight.ids), max_tokens)
    cut = len(insight.ids) - shown
    labels = token_labels(tokenizer, insight.ids)[cut:]
    context_note = (
        f" The prompt's first {insight.dropped} tokens were dropped to fit the {model.config.block_size}-token context."
        if insight.dropped
        else ""
    )
    shown_note = f" Only the last {shown} of the {len(insight.ids)} positions are drawn." if cut else ""
    drawn = _pass_pictures(model, tokenizer, insight, cut, labels, shown_note, context_note)
    drawn.append(_lens_picture(model, tokenizer, insight.ids, cut, labels, shown_note + context_note))
    if model.config.norm_position == "pre":
        drawn.append(_contributions_picture(model, tokenizer, insight.ids))
    drawn.append(icl_picture(model, tokenizer, prompt, icl_prompt, data_tokens, max_tokens))
    drawn.append(_induction_picture(model, data_tokens))
    if moe_layers(model):
        drawn.append(_routing_picture(model, tokenizer, insight.ids, cut, labels))
    pictures = [_save(out, *picture) for picture in drawn]
    atomic_write_text(out / "index.html", render_index(pictures, title, prompt, model.config))
    return pictures


def _save(out: Path, fig: Figure, file: str, heading: str, caption: str, data: dict | None = None) -> Picture:
    """Write a drawn picture's PNG (and its numbers as JSON beside it) into out."""
    save_png(fig, out / file)
    data_file = None
    if data is not None:
        data_file = Path(file).with_suffix(".json").name
        atomic_write_text(out / data_file, json.dumps(data))
    return Picture(file, heading, caption, data_file)


def _pass_pictures(
    model: GPT,
    tokenizer: Tokenizer,
    insight: PromptInsight,
    cut: int,
    labels: list[str],
    shown_note: str,
    context_note: str,
) -> list[Drawn]:
    """The pictures of the model and of the prompt's one pass: parameters, attention per layer, hidden-state norms,
    layer similarity, next-token distribution, causal mask and the activation function."""
    config = model.config
    rows_note = " The weights on earlier keys are left out, so a drawn row can sum to less than 1." if cut else ""
    drawn = [_parameters_picture(config)]
    drawn += _attention_pictures(config, insight, cut, labels, shown_note + rows_note + context_note)
    ends = " and after the final norm." if config.norm_position == "pre" else " (post-norm: each block ends in a norm)."
    last = token_labels(tokenizer, insight.ids[-1:])[0]
    drawn += [
        (
            draw_norms(hidden_state_norms(insight.hidden_states)[:, cut:], insight.state_labels, labels),
            "hidden_norms.png",
            "Hidden-state norms",
            "The L2 norm of each position's hidden state after the embedding, after each block"
            + ends
            + shown_note
            + context_note,
        ),
        (
            draw_similarity(layer_similarity(insight.hidden_states), insight.state_labels, last),
            "layer_similarity.png",
            "Similarity between layers",
            "Cosine similarity between the representations of the last prompt token after each stage: how much "
            "each block changes the residual stream.",
        ),
        (
            draw_distributions(next_token_distributions(insight.logits[-1]), tokenizer),
            "next_token.png",
            "Next-token distribution",
            f"The top {TOP_TOKENS} next tokens after the prompt under softmax(z / tau) for tau = "
            + ", ".join(f"{t:g}" for t in TEMPERATURES)
            + ": a low temperature sharpens the distribution, a high one "
            "flattens it (the order never changes).",
        ),
        (
            draw_mask(len(labels), labels),
            "causal_mask.png",
            "Causal mask",
            "M_ij = 0 where key j <= query i and -inf above the diagonal, so no position sees the future." + shown_note,
        ),
    ]
    if config.activation != "relu":
        drawn.append(_activation_picture(config))
    return drawn


def _parameters_picture(config: ModelConfig) -> Drawn:
    """Where the model's parameters are: embedding, each block's attention and MLP, norms, LM head."""
    caption = (
        f"{param_breakdown(config).total:,} parameters: the token embedding, each block's attention (fused q, k, v "
        "and output projections) and MLP, all norms together, and the LM head when it is not tied to the embedding."
    )
    return draw_parameters(config), "parameters.png", "Parameter breakdown", caption


def _attention_pictures(
    config: ModelConfig, insight: PromptInsight, cut: int, labels: list[str], notes: str
) -> list[Drawn]:
    """Each layer's attention weights over the prompt, its heads side by side."""
    return [
        (
            draw_attention(weights[:, cut:, cut:], labels, layer),
            f"attention_layer{layer}.png",
            f"Attention, layer {layer}",
            f"softmax(QK^T/sqrt(d_k) + M) for each of the {config.n_head} heads: row i shows how query token i "
            "spreads its attention over keys 0..i; each full row sums to 1 and nothing lies above the diagonal."
            + notes,
        )
        for layer, weights in enumerate(attention_maps(insight))  # layers and heads are numbered from 0
    ]


def _activation_picture(config: ModelConfig) -> Drawn:
    """The MLP's activation function beside ReLU."""
    caption = f"This model's MLP uses {config.activation}; ReLU (the original Transformer's) for comparison."
    return draw_activation(config.activation), "activation.png", "Activation function", caption


def _texts(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's own text, for the JSON files (the pictures use token_labels)."""
    return [tokenizer.decode([i]) for i in ids]


def _lens_picture(
    model: GPT, tokenizer: Tokenizer, ids: list[int], cut: int, labels: list[str], notes: str
) -> tuple[Figure, str, str, str, dict]:
    """The logit lens over the prompt: each stage's top token and its probability of the final prediction."""
    config = model.config
    top, top_prob, final_prob = measures.lens_predictions(measures.logit_lens(model, ids, first=cut))
    rows = lens_rows(config)
    top_labels = [token_labels(tokenizer, row.tolist()) for row in top]
    norm = ("the final norm and " if config.norm_position == "pre" else "") + "the LM head"
    skipped = (
        ""
        if config.norm_position == "pre"
        else (
            " Head contributions are not drawn: in a post-norm model every block ends in a norm, so a head's output "
            "reaches the logits only through the norms after it and no head has a direct path of its own."
        )
    )
    data = {
        "rows": rows,
        "positions": list(range(cut, len(ids))),
        "tokens": _texts(tokenizer, ids[cut:]),
        "top_token_ids": top.tolist(),
        "top_tokens": [_texts(tokenizer, row.tolist()) for row in top],
        "top_probability": top_prob.tolist(),
        "final_prediction_probability": final_prob.tolist(),
    }
    caption = (
        f"The residual stream after the embedding and after each block, read out through {norm} as if the model "
        "ended there. Each cell's text is the token that stage would predict next at that position; its colour is "
        "the probability that stage gives the model's eventual prediction (the top row), so a column darkens "
        "upward from where the model settles on its answer. The numbers are in logit_lens.json." + notes + skipped
    )
    return draw_logit_lens(final_prob, top_labels, rows, labels), "logit_lens.png", "Logit lens", caption, data


def _contributions_picture(model: GPT, tokenizer: Tokenizer, ids: list[int]) -> tuple[Figure, str, str, str, dict]:
    """Each head's direct contribution to the logit of the model's prediction after the prompt."""
    contributions = measures.head_contributions(model, ids)
    with torch.no_grad():
        token = int(model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1].argmax())
    label = token_labels(tokenizer, [token])[0]
    data = {
        "token_id": token,
        "token": tokenizer.decode([token]),
        "position": len(ids) - 1,
        "contributions": contributions.tolist(),
    }
    caption = (
        f"Direct logit attribution: how much each head's output at the last position, passed through the output "
        f"projection, the final norm (its scale at that position held fixed) and the LM head, adds to the logit of "
        f"the predicted next token {label}. Red heads push the prediction up, blue ones down; the embeddings, MLPs "
        "and biases make up the rest of the logit. The numbers are in head_contributions.json."
    )
    return draw_head_contributions(contributions, label), "head_contributions.png", "Head contributions", caption, data


def icl_picture(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    icl_prompt: str | None,
    data_tokens: np.ndarray | None,
    max_tokens: int,
) -> tuple[Figure, str, str, str, dict]:
    """Attention from a few-shot prompt's answer position, per layer, and the loss along the context."""
    config = model.config
    answer = None
    if icl_prompt is None:
        icl_prompt, answer = default_icl_prompt(prompt, tokenizer)
    elif not icl_prompt:
        raise InputError("--icl-prompt is empty; give a few-shot prompt (demonstrations, then a query)")
    ids = tokenizer.encode(icl_prompt)[-config.block_size :]
    if not ids:
        raise InputError("--icl-prompt encodes to no tokens; give a few-shot prompt")
    attention = measures.attention_from(model, ids)
    shown = min(len(ids), max(max_tokens, 128))  # the whole few-shot prompt where it fits: its demonstrations matter
    data: dict[str, Any] = {
        "prompt": icl_prompt,
        "expected_answer": answer,
        "tokens": _texts(tokenizer, ids),
        "attention_from_last": attention.tolist(),
    }
    losses, source, loss_note = _icl_losses(model, ids, data_tokens, data)
    data["position_losses"] = losses.tolist()
    with torch.no_grad():
        last = model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1].float().softmax(-1)
    predicted = int(last.argmax())
    data["predicted"] = {
        "token_id": predicted,
        "token": tokenizer.decode([predicted]),
        "probability": float(last[predicted]),
    }
    expected = f" (the expected answer is {answer!r})" if answer is not None else ""
    caption = (
        f"In-context learning. Top: for the few-shot prompt {icl_prompt!r}, how the last position, where the "
        f"answer is predicted, spreads its attention over the earlier tokens in each layer (mean over heads): "
        f"bright columns are the demonstration tokens it copies from. The model predicts "
        f"{tokenizer.decode([predicted])!r} with probability {float(last[predicted]):.2f}{expected}."
        + (f" Only the last {shown} of its {len(ids)} tokens are drawn." if shown < len(ids) else "")
        + loss_note
        + " The numbers are in icl.json."
    )
    labels = token_labels(tokenizer, ids)[len(ids) - shown :]
    return (
        draw_icl(attention[:, len(ids) - shown :], labels, losses, source),
        "icl.png",
        "In-context learning",
        caption,
        data,
    )


def _icl_losses(
    model: GPT, ids: list[int], data_tokens: np.ndarray | None, data: dict[str, Any]
) -> tuple[Tensor, str, str]:
    """The ICL picture's loss along the context (over windows of data_tokens, else over the prompt itself), what
    the figure says it is, and the caption's sentence on it; data gets the numbers."""
    config = model.config
    if data_tokens is not None:
        losses = measures.position_losses(model, data_tokens)
        early, late = measures.early_late_losses(losses)
        data.update(losses_over="data", icl_score=late - early, early_loss=early, late_loss=late)
        source = f"mean over {measures.ICL_WINDOWS} windows of the data"
        loss_note = (
            f" The loss curve is the mean over {measures.ICL_WINDOWS} {config.block_size}-token windows "
            f"of the data: ICL score {late - early:+.3f} (late loss {late:.3f} minus early loss "
            f"{early:.3f}; negative when the model uses its context)."
        )
    else:
        losses = measures.sequence_losses(model, ids) if len(ids) > 1 else torch.zeros(0)
        data["losses_over"] = "prompt"
        # Said on the figure too: one short text's per-token losses are mostly noise, read as a trend otherwise.
        source = (
            "the few-shot prompt itself: one short text, so mostly\nper-token noise on a small model; "
            "--data averages windows of real text"
        )
        loss_note = (
            " The loss curve is over the few-shot prompt itself, one short text, so on a small model it is mostly "
            "the noise of single tokens (give --data for the mean over windows of real text and the ICL score): a "
            "model that learns in context predicts later demonstrations better than the first."
        )
    return losses, source, loss_note


def _induction_picture(model: GPT, tokens: Any | None) -> tuple[Figure, str, str, str, dict]:
    """The induction test: each head's score on a random sequence repeated twice, and what mean-ablating the
    strongest head (and each head of its layer) changes."""
    test = measures.induction_test(model)
    chance = measures.chance_induction_score(test.length)
    strongest = ", ".join(f"layer {layer} head {h} ({v:.2f})" for layer, h, v in measures.top_heads(test.scores, 3))
    text = tokens if tokens is not None and len(tokens) > model.config.block_size else None  # (ICL needs a window)
    ablation = ablation_study(model, test.scores, text)
    data = {
        "length": test.length,
        "chance": chance,
        "first_half_loss": test.first_half_loss,
        "repeated_half_loss": test.repeated_half_loss,
        "scores": test.scores.tolist(),
        "ablation": ablation,
    }
    on_text = "" if ablation["icl_change"] is None else f" and the ICL score by {ablation['icl_change']:+.3f}"
    caption = (
        f"Induction heads. {measures.INDUCTION_BATCH} random sequences of {test.length} tokens, each repeated "
        "twice: a head's score is the attention it pays from each token of the second copy to the token that "
        "followed the same token in the first copy. 1 is a perfect induction head; uniform attention scores "
        f"{chance:.3f} (the chance level), about 1 / position. Strongest: {strongest}. The loss is "
        f"{test.first_half_loss:.3f} on the first copy and {test.repeated_half_loss:.3f} on the repeat, which "
        "falls well below the first once induction heads copy from the context. Mean-ablating the strongest head "
        f"(its output replaced by its mean over the batch) changes the repeated-half loss by "
        f"{ablation['repeat_change']:+.3f}{on_text}: a head that scores high but changes little is not the one the "
        "model copies with. The numbers, each head of its layer's ablation included, are in induction.json."
    )
    return draw_induction(test.scores, chance), "induction.png", "Induction heads", caption, data


def _routing_picture(
    model: GPT, tokenizer: Tokenizer, ids: list[int], cut: int, labels: list[str]
) -> tuple[Figure, str, str, str, dict]:
    """Which experts each token of the prompt from position cut goes to in each MoE layer, with the router's
    weights (the whole prompt is run: a token's routing depends on its context)."""
    whole = routing_of(model, ids)
    routing = replace(whole, experts=whole.experts[:, cut:], weights=whole.weights[:, cut:])  # (L, shown, k) each
    texts = _texts(tokenizer, ids[cut:])
    kinds = specialisation(routing.experts, token_kinds(texts), routing.n_experts)
    data = {
        "blocks": routing.blocks,
        "tokens": texts,
        "experts": routing.experts.tolist(),
        "weights": routing.weights.tolist(),
        "specialisation": kinds,
    }
    k = routing.experts.size(-1)
    caption = (
        f"Routing: for each mixture-of-experts layer, the {k} of {routing.n_experts} experts each prompt token goes "
        "to (columns are tokens, rows experts), coloured by the router weight its output is scaled by; blank cells "
        "are experts the token skipped. "
        "routing.json holds the choices and, per layer, the share of each expert's tokens that are punctuation, "
        "capitals, newlines or spaces against the prompt's own share (an expert far above it specialises)."
    )
    return draw_routing(routing, labels), "routing.png", "Expert routing", caption, data


def render_index(pictures: Sequence[Picture], title: str, prompt: str, config: ModelConfig) -> str:
    """A self-contained HTML page (no external resources) showing each picture with its caption."""
    esc = html.escape
    summary = (
        f"{config.n_layer} layers, {config.n_head} heads ({config.n_kv_head} kv), width {config.n_embd}, "
        f"{config.activation}, {config.norm} {config.norm_position}-norm, {config.position} positions, "
        f"context {config.block_size}, vocabulary {config.vocab_size}"
    )
    toc = "\n".join(f'<li><a href="#{esc(Path(p.file).stem)}">{esc(p.title)}</a></li>' for p in pictures)
    figures = "\n".join(
        f'<figure id="{esc(Path(p.file).stem)}"><h2>{esc(p.title)}</h2>'
        f'<img src="{esc(p.file)}" alt="{esc(p.title)}"><figcaption>{esc(p.caption)}'
        + (f' <a href="{esc(p.data)}">{esc(p.data)}</a>' if p.data else "")
        + "</figcaption></figure>"
        for p in pictures
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>gptkit inspect: {esc(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }}
img {{ max-width: 100%; height: auto; border: 1px solid #ddd; }}
figure {{ margin: 2em 0; }}
figcaption {{ color: #555; margin-top: 0.5em; }}
pre {{ background: #f4f4f4; padding: 0.8em; white-space: pre-wrap; }}
</style>
</head>
<body>
<h1>gptkit inspect: {esc(title)}</h1>
<p>{esc(summary)}</p>
<p>Prompt:</p>
<pre>{esc(prompt)}</pre>
<ul>
{toc}
</ul>
{figures}
</body>
</html>
"""
