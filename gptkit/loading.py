"""One loader above every format gptkit reads: a path in, (model, tokenizer) out.

The format is told from the path itself: a GGUF file (its magic bytes), a LoRA directory (lora_config.json: its
base loaded by this same function, then the adapters merged), a Hugging Face directory (config.json with
model_type or architectures), a quantised gptkit directory, or a gptkit directory. Each format's module knows
only its own format (gptkit.formats, the LoRA directory's too: gptkit.formats.lora); what needs two formats
(a LoRA directory's base, a gptkit directory exported to Hugging Face) is done here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptkit.adapters import fingerprint
from gptkit.chat import DEFAULT_JINJA, ChatTemplate, eos_text, load_chat_template, read_tokenizer_config
from gptkit.checkpoint import CHECKPOINTS, LATEST, checkpoint_dirs, latest_checkpoint
from gptkit.errors import GptkitError
from gptkit.formats import gguf, hf, lora, modeldir, quantized
from gptkit.model import GPT
from gptkit.tensors import CONFIG_FILE, ModelDirError, is_gptkit_dir, read_config_json, read_model_config
from gptkit.tokenizer import Tokenizer
from gptkit.weights import model_state

logger = logging.getLogger(__name__)

FORMATS = ("gguf", "lora", "hf", "quantized", "gptkit")


def model_format(path: str | Path) -> str:
    """Which of FORMATS path holds; a one-line error naming what is wrong when it holds none."""
    path = Path(path)
    if gguf.is_gguf_file(path):
        return "gguf"
    if path.is_file():
        raise ModelDirError(f"{path} is a file but not a GGUF file; give a model directory or a .gguf file")
    if lora.is_lora_dir(path):
        return "lora"
    data = read_config_json(path)  # a one-line error for a missing directory or config
    if is_gptkit_dir(path):
        return "quantized" if data.get("quantization") else "gptkit"
    if "model_type" in data or "architectures" in data:
        return "hf"
    raise ModelDirError(f"{path / CONFIG_FILE} is neither a gptkit nor a Hugging Face model config")


def resolve_model_path(path: str | Path) -> Path:
    """The model a path means: a training run's directory, or its `latest` file, means its newest complete
    checkpoint (said in a log line); a checkpoint that does not exist is a one-line error listing those that do."""
    path = Path(path)
    run = path.parent if path.name == LATEST and path.is_file() else path
    if run.is_dir() and (run / CHECKPOINTS).is_dir() and not (run / CONFIG_FILE).exists():
        newest = latest_checkpoint(run)
        if newest is None:
            raise ModelDirError(
                f"{run} is a training run without a complete checkpoint yet; train until its first "
                "checkpoint (train.checkpoint_interval) or give a model directory"
            )
        logger.info("%s is a training run: using its newest checkpoint, %s", path, newest)
        return newest
    if not path.exists() and path.parent.name == CHECKPOINTS and path.parent.is_dir():
        have = [p.name for p in reversed(checkpoint_dirs(path.parent.parent))]
        raise ModelDirError(
            f"checkpoint {path} does not exist; {path.parent} holds {', '.join(have) if have else 'no checkpoint'}"
        )
    return path


def load(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[GPT, Tokenizer | None]:
    """(model in eval mode, tokenizer or None when the path holds none) from any format gptkit reads; a run
    directory means its newest checkpoint (resolve_model_path)."""
    path = resolve_model_path(path)
    kind = model_format(path)
    if kind == "gguf":
        return gguf.load_gguf(path, dtype=dtype, device=device)
    if kind == "hf":
        return hf.load_hf(path, dtype=dtype, device=device)
    if kind == "lora":
        lora.base_chain(path)  # a cycle of bases is one line, not a RecursionError
        settings = lora.read_lora_config(path)
        base, tokenizer, _ = load_base(settings["base"], settings["base_fingerprint"], device)
        return lora.merged(base, path, dtype), tokenizer
    if kind == "quantized":
        model = quantized.load_quantized_dir(path, device=device, dtype=dtype)
    else:
        model = modeldir.load_model_dir(path, device=device, dtype=dtype)
    return model, modeldir.load_model_tokenizer(path)


def load_base(
    base: str | Path, expected: str | None = None, device: torch.device | str | None = None
) -> tuple[GPT, Tokenizer | None, str]:
    """(model, tokenizer, fingerprint) of the base model of LoRA adapters, as stored; expected checks the
    fingerprint (a changed or missing base is a one-line error)."""
    if not Path(base).exists():
        raise GptkitError(
            f"the base model {base} of these adapters is missing; put it back (or convert a merged "
            "model with `gptkit convert --merge` while it exists)"
        )
    model, tokenizer = load(base, device=device)
    found = fingerprint(model_state(model))
    if expected is not None and found != expected:
        raise GptkitError(
            f"the base model {base} has changed since the adapters were trained on it (its weights "
            f"hash to {found[:12]}, the adapters expect {expected[:12]})"
        )
    return model, tokenizer, found


def adapted_model(settings: dict[str, Any], device: torch.device | str | None = None) -> tuple[nn.Module, Any]:
    """(the checked base in its training precision with fresh adapters, tokenizer) for a LoRA run's settings."""
    model, tokenizer, _ = load_base(settings["base"], settings["base_fingerprint"], device)
    return lora.adapt(model, settings), tokenizer


def export_hf(
    model_or_dir: GPT | str | Path,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    head: tuple[list[str], torch.Tensor] | None = None,
    family: str | None = None,
) -> Path:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files) equal to the model, as
    family (a model_type such as "mistral"; default: the one the model's settings call for).

    model_or_dir is a GPT or a gptkit model directory (other formats: gptkit.load them first), whose tokenizer and
    tokenizer_config.json (chat template, special-token names) come along unless given; dtype casts the weights of
    a directory's model. head (labels, score weight) writes a sequence classifier instead of a causal LM, padding
    with the end-of-text id. See gptkit.formats.hf.export_hf.
    """
    if isinstance(model_or_dir, (str, Path)):
        model = modeldir.load_model_dir(model_or_dir, dtype=dtype)
        tokenizer = tokenizer if tokenizer is not None else modeldir.load_model_tokenizer(model_or_dir)
        tokenizer_config = tokenizer_config if tokenizer_config is not None else read_tokenizer_config(model_or_dir)
    else:
        model = model_or_dir
    return hf.export_hf(
        model, out_dir, tokenizer=tokenizer, tokenizer_config=tokenizer_config, head=head, family=family
    )


def chat_template(path: str | Path, tokenizer: Tokenizer | None) -> ChatTemplate:
    """The chat template of the model at path: a GGUF file's own (tokenizer.chat_template), a directory's
    tokenizer_config.json, or the default, ending replies with the tokenizer's end-of-text text."""
    eos = eos_text(tokenizer) if tokenizer is not None else ""
    if gguf.is_gguf_file(path):
        source = gguf.gguf_chat_template(path)
        return ChatTemplate(eos_token=eos) if source in (None, DEFAULT_JINJA) else ChatTemplate(source, "", eos)
    return load_chat_template(path, eos)


def model_context(path: str | Path) -> int | None:
    """The context length (block_size) of the model at path, or None when path holds no model gptkit reads."""
    try:
        path = resolve_model_path(path)
        kind = model_format(path)
        if kind in ("gptkit", "quantized"):
            return read_model_config(path).block_size
        if kind == "lora":
            return model_context(lora.base_chain(path)[-1])
        return load(path)[0].config.block_size
    except GptkitError:
        return None
