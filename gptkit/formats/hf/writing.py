"""Writing Hugging Face checkpoints: the HF config and tensors equal to a GPT, as a directory or a transformers model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from torch import Tensor

from gptkit.atomic import atomic_write_text
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.formats.hf.config_map import HINT_KEY, config_from_hf, hf_config_from_gptkit
from gptkit.formats.hf.layouts import LAYOUTS, ConversionError, export_tensor, weight_rules, with_biases
from gptkit.formats.hf.tokenizer import write_hf_tokenizer
from gptkit.model import GPT
from gptkit.tensors import CONFIG_FILE, WEIGHTS_FILE, save_tensors
from gptkit.tokenizer import Tokenizer
from gptkit.weights import model_state, real_vocab_state


def hf_checkpoint(
    model: GPT, tokenizer: Tokenizer | None = None, family: str | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The HF config.json dict and state dict equal to model, as family (a model_type such as "mistral"; by default
    the one the model's settings call for), or a ConversionError saying why none is."""
    module = getattr(model, "_orig_mod", model)
    config: ModelConfig = module.config
    eos_ids = list(tokenizer.eos_ids) if tokenizer is not None else []
    hf = hf_config_from_gptkit(config, eos_ids[0] if len(eos_ids) == 1 else eos_ids or None, family)
    layout = LAYOUTS[hf["architectures"][0]]
    target = config_from_hf(hf, layout, "export")  # the config HF's model will have (e.g. with zero biases)
    state = with_biases(real_vocab_state(model_state(module), config), config, target)  # a padded head's rows cut
    hf_state: dict[str, Tensor] = {}
    for rule in weight_rules(target, layout):
        hf_state.update(export_tensor(rule, state[rule.ours]))
    dtype = str(state["tok_emb.weight"].dtype).removeprefix("torch.")
    hf.update(dtype=dtype, torch_dtype=dtype)
    hf[HINT_KEY] = dataclasses.replace(config, vocab_multiple=1).to_dict()  # HF holds the real rows only
    return hf, hf_state


# transformers' sequence-classification class for each causal-LM class gptkit writes.
CLASSIFIER_ARCHITECTURES = {
    "GPT2LMHeadModel": "GPT2ForSequenceClassification",
    "LlamaForCausalLM": "LlamaForSequenceClassification",
    "MistralForCausalLM": "MistralForSequenceClassification",
    "Qwen2ForCausalLM": "Qwen2ForSequenceClassification",
    "Qwen3ForCausalLM": "Qwen3ForSequenceClassification",
    "Gemma2ForCausalLM": "Gemma2ForSequenceClassification",
    "Gemma3ForCausalLM": "Gemma3TextForSequenceClassification",
    "Phi3ForCausalLM": "Phi3ForSequenceClassification",
    "SmolLM3ForCausalLM": "SmolLM3ForSequenceClassification",
    "Olmo2ForCausalLM": "Olmo2ForSequenceClassification",
    "GPTNeoXForCausalLM": "GPTNeoXForSequenceClassification",
}


def hf_classifier_checkpoint(
    hf: dict[str, Any], hf_state: dict[str, Tensor], labels: list[str], score: Tensor, pad_id: int | None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A causal LM's config and state turned into its *ForSequenceClassification: the same body, and a linear
    head without bias (score) that transformers reads at each row's last token that is not pad_id."""
    architecture = CLASSIFIER_ARCHITECTURES.get(hf["architectures"][0])
    if architecture is None:
        raise ConversionError(f"transformers has no sequence classifier for {hf['architectures'][0]} here")
    head = f"{LAYOUTS[hf['architectures'][0]].head}.weight"
    hf = dict(
        hf,
        architectures=[architecture],
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        pad_token_id=pad_id,
        problem_type="single_label_classification",
    )
    state = {name: tensor for name, tensor in hf_state.items() if name != head}
    state["score.weight"] = score.detach().to(next(iter(hf_state.values())).dtype)
    return hf, state


def hf_block_modules(config: ModelConfig) -> tuple[dict[str, list[tuple[str, int | None]]], bool]:
    """Where each gptkit block layer ("blocks.0.attn.qkv") lives in the exported HF model: its modules, each with
    the rows of the layer's output it takes (None: all), and whether they store weights transposed (Conv1D)."""
    hf = hf_config_from_gptkit(config)
    layout = LAYOUTS[hf["architectures"][0]]
    modules = {}
    for i in range(config.n_layer):
        layer = f"{layout.base}{layout.layers}.{i}."
        for spec in layout.block:
            if not spec.applies(config, i) or spec.per_expert:
                continue  # experts are no nn.Linear modules an adapter wraps
            if spec.order is not None:
                why = f"{layout.model_type} orders the rows of {spec.theirs[0]} per head, which adapters cannot cut"
                raise ConversionError(f"{spec.ours} cannot be mapped to Hugging Face modules: {why}")
            rows = spec.rows(config) if spec.rows is not None else (None,)
            modules[f"blocks.{i}.{spec.ours}"] = [(layer + their, r) for their, r in zip(spec.theirs, rows)]
    return modules, any(spec.transposed for spec in layout.block)


def hf_model_from_gpt(model: GPT, family: str | None = None) -> Any:
    """An in-memory transformers model (GPT2LMHeadModel, LlamaForCausalLM, ... as hf_checkpoint chooses) computing
    what model does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, hf_state = hf_checkpoint(model, family=family)
    head = f"{LAYOUTS[hf['architectures'][0]].head}.weight"
    if head in hf_state:  # the in-memory model names every head lm_head
        hf_state = {"lm_head.weight" if name == head else name: tensor for name, tensor in hf_state.items()}
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")}
    hf_config = AutoConfig.for_model(hf["model_type"], **fields)
    hf_config.architectures = hf["architectures"]
    reference = hf_state[next(iter(hf_state))]
    hf_model = AutoModelForCausalLM.from_config(hf_config).to(device=reference.device, dtype=reference.dtype)
    result = hf_model.load_state_dict(hf_state, strict=False)
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        name = missing[0] if missing else result.unexpected_keys[0]
        raise ConversionError(f"the transformers model and the exported state disagree on tensor {name!r}")
    return hf_model.eval()


def export_hf(
    model: GPT,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    head: tuple[list[str], Tensor] | None = None,
    family: str | None = None,
) -> Path:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer files) equal to the model.

    tokenizer_config is the model's tokenizer_config.json (chat template, special-token names): the export renders
    chats as gptkit does, with the model's own template or gptkit's default (gptkit.formats.hf.tokenizer); head (labels,
    score weight) writes a sequence classifier instead of a causal LM, padding with the end-of-text id. A model
    directory is exported by gptkit.export_hf (gptkit.loading.export_hf), which loads it and calls this.
    """
    if isinstance(model, (str, Path)):
        raise ConfigError(f"export_hf takes a GPT; export the directory {model} with gptkit.export_hf")
    hf, hf_state = hf_checkpoint(model, tokenizer, family)
    if head is not None:
        pad_id = tokenizer.eos_id if tokenizer is not None else None
        hf, hf_state = hf_classifier_checkpoint(hf, hf_state, head[0], head[1], pad_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(hf_state, out / WEIGHTS_FILE, metadata={"format": "pt"})
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out, tokenizer_config)
    atomic_write_text(out / CONFIG_FILE, json.dumps(hf, indent=2) + "\n")
    return out
