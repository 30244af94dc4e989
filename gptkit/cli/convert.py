"""`gptkit convert`: import a Hugging Face checkpoint directory, or export a gptkit model directory to one."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from gptkit.atomic import atomic_write_text, building_dir, reported
from gptkit.chat import DEFAULT_JINJA, TOKENIZER_CONFIG, eos_text, load_chat_template, read_tokenizer_config
from gptkit.errors import GptkitError
from gptkit.tensors import read_config_json

DTYPES = ("float32", "bfloat16", "float16")
SOURCE_KEPT = "the source is unchanged"  # said with every failed write: convert never writes to its source
MARKER = "config.json"  # the file that makes a model directory (gptkit's or Hugging Face's) complete
# config.json's key (beside "model") naming the Hugging Face model_type a directory was imported from, so that an
# export without --family writes the family it came as (Mistral v0.3 has no window that would call for mistral).
HF_FAMILY_KEY = "hf_family"


# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "convert between gptkit model directories, Hugging Face checkpoints (16 families) and GGUF files; merge LoRA"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `convert` sub-command."""
    parser = subparsers.add_parser(
        "convert",
        help=HELP,
        description="Import a local Hugging Face checkpoint directory (GPT-2, Llama, Mistral, Qwen, Gemma, Phi-3, "
        "SmolLM3, OLMo 2, GPT-NeoX, Granite and the MoE families) as a gptkit model directory, or export a gptkit "
        "model directory as a checkpoint that transformers loads, as the family --family names (default: the one "
        "the model was imported as, else the one its settings call for). Anything that cannot be converted exactly "
        "is refused with the reason.",
    )
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR", type=Path, help="Hugging Face directory to import")
    direction.add_argument(
        "--to-hf",
        metavar="MODEL_DIR",
        type=Path,
        help="gptkit model directory to export (a "
        "LoRA directory: merged, with its adapters in PEFT's format in OUT/adapter)",
    )
    direction.add_argument(
        "--merge",
        metavar="LORA_DIR",
        type=Path,
        help="LoRA directory (or checkpoint) to fold into its base as a plain gptkit model directory",
    )
    direction.add_argument(
        "--to-gguf",
        metavar="MODEL_DIR",
        type=Path,
        help="model directory to write as a GGUF "
        "file for llama.cpp (--out FILE.gguf; a LoRA directory is merged first)",
    )
    direction.add_argument(
        "--from-gguf",
        metavar="FILE",
        type=Path,
        help="GGUF file (gpt2 or llama architecture) to import as a gptkit model directory",
    )
    parser.add_argument(
        "--out", metavar="PATH", type=Path, required=True, help="directory to write (--to-gguf: the .gguf file)"
    )
    parser.add_argument(
        "--type",
        choices=("f32", "f16", "bf16", "q8_0", "q4_0"),
        default="f16",
        dest="gguf_type",
        help="--to-gguf: the matrices' type (vectors stay f32; default f16, as llama.cpp's converter; "
        "q4_0 repacks an int4 model's own bits)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default=None, help="store the weights in this dtype (default: as they are)"
    )
    parser.add_argument(
        "--family",
        metavar="NAME",
        default=None,
        help="--to-hf: the Hugging Face model_type to write (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, "
        "smollm3, olmo2, gpt_neox, granite, gpt2, ...; default: the family the model was imported as, else the one "
        "its settings call for)",
    )
    parser.add_argument("--force", action="store_true", help="write into --out even if it is not empty")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Convert in the direction asked and print what was written."""
    import torch

    if args.to_gguf is not None:
        return _to_gguf(args.to_gguf, args.out, args.gguf_type, args.force)
    if args.gguf_type != "f16":
        raise GptkitError("--type applies to --to-gguf only; --dtype sets the weights' dtype of a model directory")
    if args.family is not None and args.to_hf is None:
        raise GptkitError("--family applies to --to-hf only (an import reads the family from the checkpoint)")
    source: Path = next(p for p in (args.from_hf, args.to_hf, args.merge, args.from_gguf) if p is not None)
    if args.from_gguf is not None:
        if not source.is_file():
            raise GptkitError(f"--from-gguf {source} is not a file")
    elif not source.is_dir():
        raise GptkitError(f"{source} is not a directory")
    if args.out.exists() and not args.out.is_dir():
        raise GptkitError(f"--out {args.out} exists and is not a directory")
    if args.out.is_dir() and args.out.resolve() == source.resolve():
        raise GptkitError("--out must differ from the directory being converted")
    if args.out.is_dir() and any(args.out.iterdir()) and not args.force:
        raise GptkitError(f"--out {args.out} is not empty; pick a new directory or pass --force")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.from_hf is not None or args.from_gguf is not None:
        return _import(source, args.out, dtype)
    if args.merge is not None:
        return _merge(source, args.out, dtype)
    return _export(source, args.out, dtype, args.family)


def _merge(source: Path, out: Path, dtype: object) -> int:
    from gptkit.formats.lora import is_lora_dir
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.loading import load

    if not is_lora_dir(source):
        raise GptkitError(
            f"{source} is not a LoRA directory (no lora_config.json); --merge folds adapters into their base"
        )
    model, tokenizer = load(source, dtype=dtype)
    with _building(out) as stage:
        save_model_dir(model, stage, tokenizer=tokenizer)
        _carry_tokenizer_config(source, stage)  # the chat template the model was fine-tuned with
    _summary(model, source, out)
    return 0


def _to_gguf(source: Path, out: Path, file_type: str, force: bool) -> int:
    from gptkit.formats.gguf import export_gguf
    from gptkit.formats.gguf.vocab import tokenizer_vocab
    from gptkit.loading import load

    if not source.is_dir():
        raise GptkitError(f"--to-gguf {source} is not a directory")
    if out.is_dir():
        raise GptkitError(f"--out {out} is a directory; give the .gguf file to write")
    if out.exists() and not force:
        raise GptkitError(f"--out {out} exists; pick a new file or pass --force")
    model, tokenizer = load(source)
    template = load_chat_template(source, eos_text(tokenizer) if tokenizer is not None else "")
    with reported(out, SOURCE_KEPT):  # one file, written beside out and renamed over it (atomic_write)
        export_gguf(model, out, tokenizer, file_type, chat_template=template.jinja, name=source.resolve().name)
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    vocab = tokenizer_vocab(tokenizer)  # the file's tokens: a char tokenizer's gains an end-of-text token
    added = f" ({config.vocab_size} + {', '.join(vocab.tokens[-vocab.added :])})" if vocab.added else ""
    print(
        f"{source} -> {out}: GGUF {file_type}, {config.n_layer} layers, width {config.n_embd}, vocab "
        f"{len(vocab.tokens)}{added}, {params:,} parameters, {out.stat().st_size / 2**20:.1f} MiB"
    )
    return 0


def _import(source: Path, out: Path, dtype: object) -> int:
    from gptkit.formats.hf import detect_family, load_hf
    from gptkit.formats.hf.tokenizer import TOKENIZER_FILE
    from gptkit.formats.modeldir import save_model_dir

    if source.is_file():  # --from-gguf
        return _import_gguf(source, out, dtype)
    model, tokenizer = load_hf(source, dtype=dtype)
    with _building(out) as stage:
        save_model_dir(model, stage, tokenizer=tokenizer)
        _remember_family(stage, detect_family(json.loads((source / MARKER).read_text()), str(source)).model_type)
        if tokenizer is not None:  # chat templates and special-token names, for serving and a later export
            _carry_tokenizer_config(source, stage)
    if tokenizer is None:
        hint = (
            " (it has vocab.json/merges.txt only; re-save it with a fast tokenizer)"
            if (source / "vocab.json").is_file()
            else ""
        )
        print(f"note: {source} has no {TOKENIZER_FILE}; the model directory has no tokenizer{hint}", file=sys.stderr)
    _summary(model, source, out)
    return 0


def _import_gguf(source: Path, out: Path, dtype: object) -> int:
    from gptkit.formats.gguf import gguf_chat_template, load_gguf
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.formats.quantized import save_quantized_dir
    from gptkit.quantization import is_quantized

    model, tokenizer = load_gguf(source, dtype=dtype)
    template = gguf_chat_template(source)
    with _building(out) as stage:
        if is_quantized(model):  # Q4_0 layers stay int4
            save_quantized_dir(model, stage, tokenizer=tokenizer)
        else:
            save_model_dir(model, stage, tokenizer=tokenizer)
        # Kept where serve and fine-tuning find a model's template, as Hugging Face keeps it.
        if template is not None and template != DEFAULT_JINJA:
            config = {"chat_template": template, "eos_token": tokenizer.decode([tokenizer.eos_id])}
            atomic_write_text(stage / TOKENIZER_CONFIG, json.dumps(config, indent=1) + "\n")
    _summary(model, source, out)
    return 0


def _remember_family(model_dir: Path, model_type: str) -> None:
    """Add the Hugging Face model_type an imported model came as to its config.json (HF_FAMILY_KEY)."""
    data = read_config_json(model_dir)
    data[HF_FAMILY_KEY] = model_type
    atomic_write_text(model_dir / MARKER, json.dumps(data, indent=2) + "\n")


def imported_family(model_dir: Path) -> str | None:
    """The Hugging Face model_type a gptkit model directory was imported as, or None (trained here, or no config)."""
    try:
        family = read_config_json(model_dir).get(HF_FAMILY_KEY)
    except GptkitError:
        return None
    return family if isinstance(family, str) else None


def _export(source: Path, out: Path, dtype: object, family: str | None) -> int:
    from gptkit.finetune.heads import is_classifier_dir, load_head
    from gptkit.formats.hf import export_hf, hf_block_modules
    from gptkit.formats.lora import is_lora_dir, write_peft_dir
    from gptkit.loading import load

    model, tokenizer = load(source, dtype=dtype)
    family = family if family is not None else imported_family(source)
    head = None
    if is_classifier_dir(source):  # a classifier: transformers' *ForSequenceClassification
        classifier = load_head(model, source)
        head = (classifier.labels, classifier.score.weight)
    with _building(out) as stage:
        tokenizer_config = read_tokenizer_config(source)
        export_hf(model, stage, tokenizer=tokenizer, tokenizer_config=tokenizer_config, head=head, family=family)
        if is_lora_dir(source):
            write_peft_dir(source, stage / "adapter", *hf_block_modules(model.config))
    if tokenizer is None:
        print(f"note: {source} has no tokenizer; the Hugging Face directory has none either", file=sys.stderr)
    if is_lora_dir(source):
        print(
            f"note: the adapters alone, in PEFT's format, are in {out / 'adapter'}: load them with "
            "peft.PeftModel.from_pretrained over the base exported by `gptkit convert --to-hf BASE`",
            file=sys.stderr,
        )
    _summary(model, source, out)
    return 0


def _building(out: Path) -> contextlib.AbstractContextManager[Path]:
    """A hidden directory beside out to write the conversion in, put in out's place only when it is complete
    (files already in an existing out stay unless replaced); a failed write removes it and says so in one line."""
    return building_dir(out, MARKER, note=SOURCE_KEPT)


def _summary(model: object, source: Path, out: Path) -> None:
    config = model.config  # type: ignore[attr-defined]
    params = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    print(
        f"{source} -> {out}: {config.n_layer} layers, width {config.n_embd}, {config.n_head} heads "
        f"({config.n_kv_head} kv), vocab {config.vocab_size}, {params:,} parameters, {dtype}"
    )


def _carry_tokenizer_config(source: Path, out: Path) -> None:
    """Write source's tokenizer_config.json (with the template of a chat_template.jinja beside it) into out."""
    carried = read_tokenizer_config(source)
    if carried is not None:
        atomic_write_text(out / TOKENIZER_CONFIG, json.dumps(carried, indent=2, ensure_ascii=False) + "\n")
