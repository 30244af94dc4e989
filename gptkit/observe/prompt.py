"""What a prompt shows inside a model (docs/spec.md section 5), as plain tensors and lists every front end reuses
(`gptkit inspect`'s report, the HTTP playground): attention, hidden-state norms, layer similarity, next-token
distributions, the parameter breakdown, token labels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gptkit.accounting import attention_params, mlp_params, norm_params, param_breakdown
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.model import GPT, Trace
from gptkit.observe import measures
from gptkit.tokenizer import Tokenizer

TEMPERATURES = (0.5, 1.0, 2.0)


MAX_HEATMAP_TOKENS = 48  # beyond this, token labels become unreadable: heatmaps show the last positions only


DEFAULT_PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak."


ICL_DEMONSTRATIONS = 4  # word pairs before the query in the default few-shot prompt


@dataclass(frozen=True)
class PromptInsight:
    """One traced forward pass over a prompt, as float32 CPU tensors."""

    ids: list[int]  # the tokens the model saw (the prompt's last block_size tokens for learned positions)
    dropped: int  # prompt tokens cut from the front to fit the context
    attentions: list[Tensor]  # per layer: (n_head, T, T), row i = how query i spreads over keys 0..i
    hidden_states: list[Tensor]  # (T, d) after the embedding, each block and (pre-norm) the final norm
    state_labels: list[str]  # a name for each hidden state
    logits: Tensor  # (T, vocab_size)


def state_labels(config: ModelConfig) -> list[str]:
    """Names of the hidden states a Trace records, in order."""
    labels = ["embedding"] + [f"layer {i}" for i in range(config.n_layer)]  # numbered from 0, as everywhere
    return labels + (["final norm"] if config.norm_position == "pre" else [])


@torch.no_grad()
def prompt_insight(model: GPT, ids: Sequence[int]) -> PromptInsight:
    """Run ids (one sequence) through model with a Trace; the context keeps its last block_size tokens."""
    if len(ids) == 0:
        raise InputError("the prompt encodes to no tokens; give a non-empty --prompt")
    config = model.config
    keep = list(ids)[-config.block_size :]
    trace = Trace()
    logits = measures.eval_forward(model, torch.tensor([keep]), trace)
    return PromptInsight(
        ids=keep,
        dropped=len(ids) - len(keep),
        attentions=[a[0].float().cpu() for a in trace.attentions],
        hidden_states=[h[0].float().cpu() for h in trace.hidden_states],
        state_labels=state_labels(config),
        logits=logits[0].float().cpu(),
    )


def attention_maps(insight: PromptInsight) -> list[Tensor]:
    """Per layer, the (n_head, T, T) attention weights: rows sum to 1, zero above the diagonal."""
    return insight.attentions


def hidden_state_norms(hidden_states: Sequence[Tensor]) -> Tensor:
    """(states, T): the L2 norm of each position's hidden state after each stage."""
    return torch.stack([h.norm(dim=-1) for h in hidden_states])


def layer_similarity(hidden_states: Sequence[Tensor], position: int = -1) -> Tensor:
    """(states, states): cosine similarity between the stages' representations of one position."""
    vectors = torch.stack([h[position] for h in hidden_states])  # (states, d)
    unit = vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.T


def next_token_distributions(logits: Tensor, temperatures: Sequence[float] = TEMPERATURES) -> dict[float, Tensor]:
    """softmax(z / tau) of one position's logits (V,) for each temperature tau > 0."""
    if any(t <= 0 for t in temperatures):
        raise InputError(f"temperatures must be > 0, got {list(temperatures)}")
    return {t: torch.softmax(logits.float() / t, dim=-1) for t in temperatures}


def token_probabilities(logits: Tensor, ids: Sequence[int]) -> Tensor:
    """(T-1,): the probability the model gave each actual next token ids[1:], from logits (T, V)."""
    targets = torch.tensor(list(ids[1:]), dtype=torch.long)
    probs = torch.softmax(logits[: len(targets)].float(), dim=-1)
    return probs.gather(1, targets[:, None])[:, 0]


def causal_mask(size: int) -> Tensor:
    """(size, size) booleans: True where query i may attend to key j (j <= i)."""
    return torch.ones(size, size, dtype=torch.bool).tril()


def parameter_parts(config: ModelConfig) -> list[tuple[str, int]]:
    """Parameter counts by part: embeddings, each block's attention and MLP, all norms, the head (from accounting)."""
    totals = param_breakdown(config)
    parts = [("token embedding" + (" (tied head)" if config.tie_embeddings else ""), totals.token_embedding)]
    if totals.position_embedding:
        parts.append(("position embedding", totals.position_embedding))
    for i in range(config.n_layer):
        parts += [(f"layer {i} attention", attention_params(config)), (f"layer {i} MLP", mlp_params(config))]
    parts.append((f"norms ({totals.norms // norm_params(config)})", totals.norms))
    if totals.lm_head:
        parts.append(("LM head", totals.lm_head))
    return parts


def token_label(text: str, width: int = 12) -> str:
    """A token's text made visible and safe for a plot label: spaces as ␣, control characters escaped."""
    out = []
    for ch in text:
        if ch == " ":
            out.append("\u2423")
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        elif ch == "$":
            out.append("\\$")  # a bare $ would start matplotlib's mathtext
        else:
            out.append(ch)
    label = "".join(out) or "\u2205"
    return label if len(label) <= width else label[: width - 1] + "\u2026"


def token_labels(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """The display label of each token, decoded one by one; a token holding part of a character shows its bytes."""
    labels = []
    for i in ids:
        text, data = tokenizer.decode([i]), tokenizer.token_bytes(i)
        if "\ufffd" in text and data != text.encode("utf-8"):
            text = "".join(f"<{b:02X}>" for b in data)  # bytes of an incomplete character
        labels.append(token_label(text))
    return labels


def _encodes(tokenizer: Tokenizer, text: str) -> bool:
    """Whether tokenizer encodes text and decodes it back unchanged (a char vocabulary may lack a character)."""
    try:
        return tokenizer.decode(tokenizer.encode(text)) == text
    except InputError:
        return False


def default_icl_prompt(prompt: str, tokenizer: Tokenizer) -> tuple[str, str]:
    """A few-shot copying prompt built from the prompt's own words, and its expected answer: demonstrations
    "w1 w1", "w2 w2", ... one a line, then the query "wq " whose answer is wq. Only the prompt's characters and
    separators the tokenizer round-trips are used, so it works for char, byte and BPE tokenizers alike."""
    words = list(dict.fromkeys(prompt.split()))  # distinct words, in order
    if len(words) < 2:
        chars = list(dict.fromkeys(ch for ch in prompt if not ch.isspace()))  # one word: its characters
        words = chars if len(chars) >= 2 else words
    if not words:
        raise InputError("the prompt is only white space; give --icl-prompt for the few-shot picture")
    pair = next((sep for sep in (" ", ":", "") if not sep or _encodes(tokenizer, sep)), "")
    line = next((sep for sep in ("\n", " ", ";", "") if not sep or (sep != pair and _encodes(tokenizer, sep))), "")
    count = min(ICL_DEMONSTRATIONS, max(1, len(words) - 1))
    demos, query = words[:count], words[count % len(words)]  # a single word is its own query
    return "".join(f"{w}{pair}{w}{line}" for w in demos) + f"{query}{pair}", query


def lens_rows(config: ModelConfig) -> list[str]:
    """Names of the logit lens's rows: the residual stream after the embedding and after each layer (from 0)."""
    return ["embedding"] + [f"layer {i}" for i in range(config.n_layer)]
