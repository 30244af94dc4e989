"""`gptkit inspect`: PNG pictures of what is inside a model, and an index.html showing them."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptkit.atomic import building_dir
from gptkit.errors import InputError

# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "pictures of what is inside a model (attention, hidden states, logit lens, induction heads, ...)"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `inspect` sub-command."""
    from gptkit.observe.prompt import DEFAULT_PROMPT, MAX_HEATMAP_TOKENS

    parser = subparsers.add_parser(
        "inspect",
        help=HELP,
        description="Run a prompt through MODEL_DIR and write PNG pictures into --out with an index.html showing "
        "them: the parameter breakdown, attention heatmaps per layer and head, hidden-state norms, the cosine "
        "similarity between layers, the next-token distribution at temperatures 0.5, 1 and 2, the causal mask and "
        "the activation function against ReLU, the logit lens, each head's direct contribution to the prediction, "
        "the in-context learning picture (attention from a few-shot prompt's answer position, the loss along the "
        "context), the induction-head scores and, for a mixture of experts, the experts each token goes to, each with "
        "its numbers in a JSON file beside it.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a gptkit (or Hugging Face) model directory")
    parser.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help="text to run through the model (default: the first line of tiny shakespeare)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the PNGs and index.html")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_HEATMAP_TOKENS,
        help=f"draw at most this many of the last positions in heatmaps (default: {MAX_HEATMAP_TOKENS})",
    )
    parser.add_argument(
        "--icl-prompt",
        metavar="TEXT",
        help="the few-shot prompt of the ICL picture: "
        "demonstrations, then a query (default: copying pairs built from the prompt's words)",
    )
    parser.add_argument(
        "--data",
        metavar="DATA_DIR",
        help="a directory made by `gptkit prepare`: the ICL picture's "
        "loss curve is the mean over windows of its val.bin (default: over the few-shot prompt)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (default: auto)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Write the pictures and print where index.html is."""
    from gptkit.devices import pick_device
    from gptkit.loading import load, resolve_model_path
    from gptkit.observe.report import write_report

    if not args.prompt:
        raise InputError("--prompt is empty; give some text to run through the model")
    args.model_dir = str(resolve_model_path(args.model_dir))  # a run directory: its newest checkpoint
    model, tokenizer = load(args.model_dir, device=pick_device(args.device))
    if tokenizer is None:
        raise InputError(f"{args.model_dir} has no tokenizer files; inspect needs one to encode the prompt")
    tokens = None
    if args.data is not None:
        from gptkit.data import is_examples, read_meta
        from gptkit.evaluate import val_tokens

        if is_examples(read_meta(args.data)):
            raise InputError(f"--data {args.data} holds separate examples; the loss curve reads running text")
        tokens, _ = val_tokens(args.data, tokenizer, args.model_dir)
    # Drawn beside --out and put in its place whole: a full disk or a read-only directory leaves no half report.
    with building_dir(args.out, "index.html") as stage:
        pictures = write_report(
            model,
            tokenizer,
            args.prompt,
            stage,
            title=Path(args.model_dir).name,
            max_tokens=args.max_tokens,
            icl_prompt=args.icl_prompt,
            data_tokens=tokens,
        )
    print(f"wrote {len(pictures)} pictures and {Path(args.out) / 'index.html'}")
    return 0
