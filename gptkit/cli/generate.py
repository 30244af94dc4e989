"""`gptkit generate`: sample text from a model directory, streamed to stdout or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gptkit.cli.flags import add_dataclass_flags, dataclass_from_args
from gptkit.errors import GptkitError

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")


# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "generate text from a model directory (streamed, or --json with ids and timing)"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` sub-command."""
    from gptkit.decoding.lookup import LOOKUP_K, LOOKUP_NGRAM
    from gptkit.decoding.sampling import SamplingParams
    from gptkit.decoding.speculative import DRAFT_K
    from gptkit.kv_cache import KV_DTYPES
    from gptkit.quantization import QUANTIZATION_METHODS

    parser = subparsers.add_parser(
        "generate",
        help=HELP,
        description="Continue a prompt with a model: the text streams to stdout as it is decoded. The prompt comes "
        "from --prompt, --prompt-file or standard input; with none of them (and a terminal on stdin) the model "
        "starts from its end-of-text token.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a gptkit (or Hugging Face) model directory")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="the prompt text")
    source.add_argument("--prompt-file", type=Path, default=None, metavar="F", help="read the prompt from file F")
    add_dataclass_flags(parser, SamplingParams)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weight precision (default: float32)")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="where to run (default: auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, timing")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="weight-only quantisation of a float model after loading: int8 (a byte a weight) or "
        "int4 (llama.cpp's Q4_0: 4.5 bits a weight) (default: none)",
    )
    parser.add_argument(
        "--kv-cache",
        choices=list(KV_DTYPES),
        default=None,
        help="int8: keep the keys and values as int8 with a scale per token and head, a quarter of "
        "fp32's memory (default: the model's dtype)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step with torch.compile: a one-off cost (reported in --json "
        "timing) that pays back over long generations (default: eager)",
    )
    parser.add_argument(
        "--draft",
        default=None,
        metavar="DRAFT_DIR",
        help="speculative decoding with this smaller model of the same tokenizer (default: none)",
    )
    parser.add_argument(
        "--draft-k",
        type=int,
        default=DRAFT_K,
        metavar="K",
        help=f"tokens the draft proposes per target pass (default: {DRAFT_K})",
    )
    parser.add_argument(
        "--lookup",
        action="store_true",
        help="speculate without a draft model: propose the tokens that followed an earlier occurrence of the last "
        "few tokens in the prompt and output (fast on text that copies its prompt: edits, code) (default: off)",
    )
    parser.add_argument(
        "--lookup-k",
        type=int,
        default=LOOKUP_K,
        metavar="K",
        help=f"with --lookup, tokens proposed per check (default: {LOOKUP_K})",
    )
    parser.add_argument(
        "--lookup-ngram",
        type=int,
        default=LOOKUP_NGRAM,
        metavar="N",
        help=f"with --lookup, the longest match looked for, in tokens (down to 1) (default: {LOOKUP_NGRAM})",
    )
    parser.set_defaults(run=run)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from --prompt, --prompt-file, or stdin when it is not a terminal (else empty)."""
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            return args.prompt_file.read_bytes().decode("utf-8")  # as written: no \r\n -> \n translation
        except (OSError, UnicodeDecodeError) as err:
            raise GptkitError(f"cannot read --prompt-file {args.prompt_file}: {err}") from None
    if sys.stdin is not None and not sys.stdin.isatty():
        raw = getattr(sys.stdin, "buffer", None)  # bytes, so that \r\n stays as written
        try:
            return raw.read().decode("utf-8") if raw is not None else sys.stdin.read()
        except UnicodeDecodeError as err:
            raise GptkitError(f"standard input is not UTF-8 text (byte {err.start}: {err.reason})") from None
    return ""


def run(args: argparse.Namespace) -> int:
    """Load the model, generate, and print the text (or the JSON report)."""
    from gptkit.decoding.sampling import SamplingParams
    from gptkit.devices import pick_device

    params = dataclass_from_args(SamplingParams, args)  # validated before the (slow) model load
    prompt = read_prompt(args)
    import torch

    from gptkit.decoding.api import encode_prompt, generate_text, stream_text
    from gptkit.decoding.options import DecodeOptions
    from gptkit.decoding.speculative import check_draft
    from gptkit.loading import load
    from gptkit.quantization import is_quantized, quantize

    dtype, device = getattr(torch, args.dtype), pick_device(args.device)
    model, tokenizer = load(args.model_dir, dtype=dtype, device=device)  # a saved int8 directory loads as it is
    if tokenizer is None:
        raise GptkitError(
            f"{args.model_dir} has no tokenizer files; save one with the model or use gptkit.generate_ids in Python"
        )
    if args.quantize and not is_quantized(model):
        quantize(model, args.quantize)
    draft = None
    if args.draft is not None:
        draft, _ = load(args.draft, dtype=dtype, device=device)
        if args.quantize and not is_quantized(draft):
            quantize(draft, args.quantize)
        check_draft(model, draft, params, args.draft_k)
    options = DecodeOptions(
        compile=args.compile,
        draft=draft,
        draft_k=args.draft_k,
        kv_cache=args.kv_cache,
        lookup=args.lookup,
        lookup_k=args.lookup_k,
        lookup_ngram=args.lookup_ngram,
    )
    options.lookup_proposer()  # bad --lookup-k or --lookup-ngram, or --lookup with --draft: said before decoding
    prompt_length = len(encode_prompt(tokenizer, prompt))  # a bad prompt fails before anything is printed
    if model.config.position == "learned" and prompt_length > model.config.block_size:
        print(
            f"gptkit generate: note: the prompt has {prompt_length} tokens; this model (learned positions) reads "
            f"only its last {model.config.block_size}",
            file=sys.stderr,
        )
    if args.json:
        with torch.no_grad():  # warm up (allocator, kernels) so that the timing measures steady work
            model(torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device))
        [texts], result = generate_text(model, tokenizer, [prompt], params, options)
        samples = [
            {"text": text, "ids": c.ids, "finish_reason": c.finish_reason}
            for text, c in zip(texts, result.completions[0])
        ]
        report = {
            "prompt": prompt,
            "prompt_ids": encode_prompt(tokenizer, prompt),
            **samples[0],
            "samples": samples,
            "timing": result.timing.to_dict(),
        }
        print(json.dumps(report, ensure_ascii=False))
        return 0
    if params.num_beams > 1 or params.num_samples > 1:  # not streamed
        [texts], _ = generate_text(model, tokenizer, [prompt], params, options)
        print("\n---------------\n".join(texts))
        return 0
    text = ""
    for piece in stream_text(model, tokenizer, prompt, params, options):
        sys.stdout.write(piece)
        sys.stdout.flush()
        text += piece
    if not text.endswith("\n"):  # a shell prompt (or the next line of a log) starts on a line of its own;
        sys.stdout.write("\n")  # --json and the Python API give the text exactly
    return 0
