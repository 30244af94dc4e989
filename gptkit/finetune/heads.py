"""GPT-1's task head: a linear classifier over the final hidden state at each example's last real token.

The classifier wraps a GPT from outside (the model knows nothing of it): it reads the GPT's final hidden states,
takes each row's state at the position a batch names as its last real token (the end of a right-padded row, the
end of a left-padded one, wherever padding sits), and maps it to one logit per label, as transformers'
GPT2ForSequenceClassification and LlamaForSequenceClassification do (`score`, no bias). Trained with the
auxiliary language-modelling loss on the same text (GPT-1: L = L_task + lm_weight * L_lm), which one forward
pass serves: the head and the LM head read the same hidden states.

A classifier saves beside its model's files: classifier.json ({"labels": [...]}) and classifier.safetensors
(score.weight, labels x n_embd).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit.atomic import atomic_write_text
from gptkit.data import Batch
from gptkit.errors import GptkitError
from gptkit.evaluate import classification_scores
from gptkit.finetune.objectives import check_examples, example_split_losses, example_stream
from gptkit.finetune.parts import ObjectiveBase, Setup, Stats
from gptkit.loss import IGNORE_INDEX
from gptkit.settings import PartSettings, check_range
from gptkit.tensors import load_tensors, save_tensors

HEAD_CONFIG = "classifier.json"
HEAD_WEIGHTS = "classifier.safetensors"


class SequenceClassifier(nn.Module):
    """A GPT plus a linear head over the hidden state at each row's last real token."""

    def __init__(self, gpt: nn.Module, labels: list[str]) -> None:
        super().__init__()
        if len(labels) < 2:
            raise GptkitError(f"a classifier needs at least two labels, got {labels}")
        self.gpt = gpt
        self.labels = list(labels)
        weight = next(p for p in gpt.parameters() if p.is_floating_point())
        self.score = nn.Linear(gpt.config.n_embd, len(labels), bias=False, device=weight.device)
        nn.init.normal_(self.score.weight, std=0.02)  # GPT-2's initialisation, as transformers' head has

    @property
    def config(self) -> object:
        """The GPT's ModelConfig."""
        return self.gpt.config

    def forward(
        self, ids: Tensor, last: Tensor, document_ids: Tensor | None = None, targets: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(class logits (B, labels), the mean language-modelling loss over targets or None).

        last (B,) holds each row's last real position; document_ids (B, T) keeps padding apart (left padding:
        its own id before the text's, so that the text's positions start at 0)."""
        hidden = self.gpt.hidden(ids, document_ids=document_ids)  # (B, T, d)
        pooled = hidden[torch.arange(hidden.size(0), device=hidden.device), last]  # (B, d)
        logits = self.score(pooled.to(self.score.weight.dtype))
        lm_loss = None
        if targets is not None:
            lm_loss = self.gpt.loss(hidden, targets)  # the model's own head: its soft-cap, its real vocabulary
        return logits, lm_loss


def is_classifier_dir(path: str | Path) -> bool:
    """Whether a model directory (or LoRA directory) carries a classification head."""
    return (Path(path) / HEAD_CONFIG).is_file()


def save_head(classifier: SequenceClassifier, path: str | Path) -> None:
    """Write the head's labels and weight into a model directory (each file atomically)."""
    path = Path(path)
    save_tensors({"score.weight": classifier.score.weight}, path / HEAD_WEIGHTS, metadata={"format": "pt"})
    atomic_write_text(path / HEAD_CONFIG, json.dumps({"labels": classifier.labels}, indent=1) + "\n")


def load_head(gpt: nn.Module, path: str | Path) -> SequenceClassifier:
    """The classifier of a model directory: gpt with the head saved there."""
    path = Path(path)
    try:
        labels = json.loads((path / HEAD_CONFIG).read_text())["labels"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise GptkitError(f"cannot read {path / HEAD_CONFIG}: {err}") from None
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        raise GptkitError(f'{path / HEAD_CONFIG}: "labels" must be a list of strings')
    classifier = SequenceClassifier(gpt, labels)
    load_head_weights(classifier, path)
    return classifier


def load_head_weights(classifier: SequenceClassifier, path: str | Path) -> None:
    """Copy the head saved in a model directory into classifier, in place."""
    path = Path(path)
    weight = load_tensors(path / HEAD_WEIGHTS, classifier.score.weight.device).get("score.weight")
    if weight is None or tuple(weight.shape) != tuple(classifier.score.weight.shape):
        raise GptkitError(
            f"{path / HEAD_WEIGHTS} does not hold a score.weight of shape {tuple(classifier.score.weight.shape)}"
        )
    with torch.no_grad():
        classifier.score.weight.copy_(weight)


@torch.no_grad()
def predict(
    classifier: SequenceClassifier,
    rows: list[list[int]],
    batch_size: int = 16,
    on_rows: Callable[[int], Any] = lambda n: None,
) -> Tensor:
    """Label probabilities (len(rows), labels) of token-id rows, each read at its last token (right-padded
    batches: causal attention keeps padding out of every real position)."""
    device = classifier.score.weight.device
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        ids = torch.zeros((len(chunk), max(len(r) for r in chunk)), dtype=torch.long)
        for i, row in enumerate(chunk):
            ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        last = torch.as_tensor([len(r) - 1 for r in chunk])
        logits, _ = classifier(ids.to(device), last.to(device))
        out.append(logits.float().softmax(-1).cpu())
        on_rows(len(chunk))
    return torch.cat(out) if out else torch.zeros((0, len(classifier.labels)))


@dataclass
class ClassifySettings(PartSettings):
    """The classification head's settings."""

    # The head trains beside a whole model on every rank.
    data_parallel_only = True

    lm_weight: float = 0.5  # weight of the language-modelling loss beside the label's (GPT-1: 0.5)

    def validate(self) -> None:
        """A weight >= 0."""
        check_range("finetune.lm_weight", self.lm_weight, low=0.0)


class Classification(ObjectiveBase):
    """Cross-entropy of a label head over each text's last token, plus lm_weight times the next-token loss."""

    settings_type = ClassifySettings
    data_kinds = ("labelled",)
    task_metrics = {"val_accuracy": "accuracy", "val_macro_f1": None}
    step_shown = ("accuracy",)

    def __init__(self, setup: Setup) -> None:
        check_examples(setup)
        self.setup = setup
        self.lm_weight = setup.config.finetune.of(ClassifySettings).lm_weight
        self.labels = setup.data.meta.labels

    def wrap(self, gpt: nn.Module) -> nn.Module:
        """The GPT with a fresh head (the optimiser and checkpoints hold both)."""
        return SequenceClassifier(gpt, self.labels)

    def stream(self, per_update: int) -> Any:
        """Whole labelled texts, padded."""
        return example_stream(self.setup, per_update)

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The mean loss over the batch's texts, with the label loss and accuracy (and the LM loss, if weighted)."""
        loss, stats, _ = self._outputs(forward, batch)
        return loss, stats

    def _outputs(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats, Tensor]:
        # A batch of one-token texts has no next token to predict (and a mean over none is NaN).
        lm = self.lm_weight > 0 and bool((batch.y != IGNORE_INDEX).any())
        logits, lm_loss = forward(batch.x, batch.last, targets=batch.y if lm else None)
        label_loss = F.cross_entropy(logits.float(), batch.labels)
        predicted = logits.argmax(-1)
        stats = {"label_loss": label_loss.detach(), "accuracy": (predicted == batch.labels).float().mean()}
        if lm_loss is None:
            return label_loss, stats, predicted
        stats["lm_loss"] = lm_loss.detach()
        return label_loss + self.lm_weight * lm_loss, stats, predicted

    @torch.no_grad()
    def evaluate(self, forward: Callable[..., Any]) -> dict[str, float]:
        """Train and validation loss, validation accuracy and the mean F1 over the labels (macro-F1), from one pass
        over each split."""
        predicted, labels = [], []

        def loss_keeping_predictions(forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
            loss, stats, prediction = self._outputs(forward, batch)
            predicted.append(prediction.cpu())
            labels.append(batch.labels.cpu())
            return loss, stats

        train_loss, val_loss, stats = example_split_losses(self.loss, forward, self.setup, loss_keeping_predictions)
        scores = classification_scores(torch.cat(labels).numpy(), torch.cat(predicted).numpy(), self.labels)
        return {"train_eval_loss": train_loss, "val_loss": val_loss, **stats, "val_macro_f1": scores["macro_f1"]}

    def save(self, module: nn.Module, directory: Path) -> None:
        """The head beside the model's files."""
        save_head(module, directory)

    def restore(self, module: nn.Module, directory: Path) -> None:
        """The checkpoint's head, copied into the run's."""
        load_head_weights(module, directory)
