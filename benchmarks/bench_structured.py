"""Structured outputs: which grammar library, what a constrained token costs, and whether every reply validates.

Three parts (--part all runs them in turn):
- libraries: llguidance, xgrammar and outlines-core (each where installed) on one byte-level BPE vocabulary of
  --vocab-size ids (trained here on the bundled corpus and Python sources): set-up per tokenizer, compile per
  schema, and mask time per token while following one JSON document.
- cost: gptkit's batch-1 decode time per token of a random model of --shape (GPT-2 small by default), free
  against constrained to a JSON schema (llguidance, as gptkit uses it), from one run side by side.
- validity: SCHEMAS (nested objects, arrays, enums, numbers, required fields; their strings unbounded) answered
  --samples times each by a random tiny byte-level model and by one trained here for --train-steps on the bundled
  corpus: the share that parses and validates (jsonschema), and why the others ended.

    python benchmarks/bench_structured.py [--part all|libraries|cost|validity] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import site
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import gptkit
from gptkit.config import PRESETS, ModelConfig
from gptkit.decoding.api import generate_text
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.grammar import Grammar
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.model import GPT
from gptkit.native import library
from gptkit.tokenizer import BPETokenizer, ByteTokenizer

CORPUS = Path(gptkit.__file__).parent / "corpora" / "tinyshakespeare.txt"
DOCUMENT = {
    "id": 48213,
    "name": "Juliet Capulet",
    "roles": ["lover", "daughter"],
    "verona": True,
    "home": {"city": "Verona", "street": "Via Cappello 23"},
    "age": 13.5,
    "tags": [],
}
DOCUMENT_SCHEMA = {
    "type": "object",
    "required": ["id", "name", "roles", "verona", "home", "age", "tags"],
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "roles": {"type": "array", "items": {"type": "string"}},
        "verona": {"type": "boolean"},
        "home": {"type": "object", "properties": {"city": {"type": "string"}, "street": {"type": "string"}}},
        "age": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
}
_POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}
SCHEMAS = [
    {"type": "object"},
    {"type": "array"},
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"]},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["ok", "nothing"],
    },
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"point": _POINT}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"path": {"type": "array", "items": _POINT, "minItems": 1}}, "required": ["path"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind", "lives"],
            },
            {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]},
        ]
    },
    {
        "$defs": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"}},
        "type": "object",
        "properties": {"id": {"$ref": "#/$defs/id"}},
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -100, "maximum": 100},
            "grade": {"enum": ["A", "B", "C"]},
        },
        "required": ["score", "grade"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                "maxItems": 3,
            }
        },
        "required": ["matrix"],
    },
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 20},
            "year": {"type": "integer", "minimum": 1500, "maximum": 2100},
        },
        "required": ["title", "year"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {"type": "object", "properties": {"value": {"type": ["integer", "string", "null"]}}, "required": ["value"]},
    {
        "type": "object",
        "properties": {"flags": {"type": "object", "additionalProperties": {"type": "boolean"}}},
        "required": ["flags"],
    },
    {
        "type": "object",
        "properties": {
            "weather": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["c", "f"]},
                    "temperature": {"type": "number"},
                },
                "required": ["city", "unit", "temperature"],
                "additionalProperties": False,
            }
        },
        "required": ["weather"],
    },
    {"type": "integer", "minimum": 0},
    {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "label": {"const": "fixed"},
        },
        "required": ["ratio", "label"],
    },
]


@functools.lru_cache(maxsize=1)
def bpe(vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of vocab_size ids: the bundled corpus, plus Python sources where it alone has too few
    distinct merges (about 21,500)."""
    texts = [CORPUS.read_text()]
    for root in site.getsitepackages() if vocab_size > 20_000 else []:
        for path in sorted(Path(root).glob("*/*.py"))[:4000]:
            texts.append(path.read_text(errors="replace"))
    return BPETokenizer.train(texts, vocab_size)


def _unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].view(bool)


def follow_llguidance(tokenizer: BPETokenizer, ids: list[int]) -> dict:
    import llguidance

    started = time.perf_counter()
    grammar = Grammar(tokenizer, json.dumps(DOCUMENT_SCHEMA), tokenizer.vocab_size)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    constraint = grammar.start()
    compile_ = time.perf_counter() - started
    times = []
    for token in ids:
        started = time.perf_counter()
        allowed = constraint.mask(torch.zeros(tokenizer.vocab_size))[token] == 0
        constraint.advance(token)
        times.append(time.perf_counter() - started)
        assert allowed, "the document's own token was masked"
    return {
        "library": f"llguidance {llguidance.__version__}",
        "setup_s": setup,
        "compile_s": compile_,
        "mask_ms": 1000 * statistics.mean(times),
        "mask_ms_max": 1000 * max(times),
    }


def follow_xgrammar(tokenizer: BPETokenizer, ids: list[int]) -> dict:
    import xgrammar

    started = time.perf_counter()
    vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, vocab_size=tokenizer.vocab_size, stop_token_ids=[tokenizer.eos_id])
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(DOCUMENT_SCHEMA)))
    compile_ = time.perf_counter() - started
    bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)
    times = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        allowed = _unpack(bitmask[0].numpy(), tokenizer.vocab_size)[token]
        matcher.accept_token(token)
        times.append(time.perf_counter() - started)
        assert allowed, "the document's own token was masked"
    return {
        "library": f"xgrammar {xgrammar.__version__ if hasattr(xgrammar, '__version__') else ''}".strip(),
        "setup_s": setup,
        "compile_s": compile_,
        "mask_ms": 1000 * statistics.mean(times),
        "mask_ms_max": 1000 * max(times),
    }


def follow_outlines(tokenizer: BPETokenizer, ids: list[int]) -> dict:
    from importlib.metadata import version

    import outlines_core

    started = time.perf_counter()
    tokens: dict[bytes, list[int]] = {}
    for i in range(tokenizer.vocab_size):
        if i != tokenizer.eos_id:
            tokens.setdefault(tokenizer.token_bytes(i), []).append(i)
    vocabulary = outlines_core.Vocabulary(tokenizer.eos_id, tokens)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(DOCUMENT_SCHEMA))
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_ = time.perf_counter() - started
    mask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids:
        started = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        allowed = _unpack(mask.numpy(), tokenizer.vocab_size)[token]
        guide.advance(token)
        times.append(time.perf_counter() - started)
        assert allowed, "the document's own token was masked"
    return {
        "library": f"outlines-core {version('outlines_core')}",
        "setup_s": setup,
        "compile_s": compile_,
        "mask_ms": 1000 * statistics.mean(times),
        "mask_ms_max": 1000 * max(times),
    }


def libraries(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    tokenizer = bpe(args.vocab_size)
    print(
        f"tokenizer: byte-level BPE, {tokenizer.vocab_size} ids (trained in {time.perf_counter() - started:.0f} s)",
        file=sys.stderr,
    )
    ids = tokenizer.encode(json.dumps(DOCUMENT))
    rows = []
    for follow in (follow_llguidance, follow_xgrammar, follow_outlines):
        try:
            rows.append(follow(tokenizer, ids))
        except Exception as err:  # a library missing or failing is reported, not fatal to the comparison
            rows.append({"library": follow.__name__.removeprefix("follow_"), "error": f"{type(err).__name__}: {err}"})
    return {"vocab_size": tokenizer.vocab_size, "document_tokens": len(ids), "rows": rows}


def _decode_ms(model: GPT, params: SamplingParams, grammar: Grammar | None, steps: int) -> float:
    """Milliseconds per decode step of one request (the prefill not counted)."""
    engine = BatchEngine(model, 1, 64 + steps)
    request = Request(list(range(16)), params, constraint=grammar.start() if grammar else None)
    engine.add([request])
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - started
    if request.done:
        raise RuntimeError(f"the request ended ({request.finish_reason}) before {steps} steps: nothing to compare")
    return 1000 * elapsed / steps


def cost(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = GPT(ModelConfig.preset(args.shape)).eval()
    tokenizer = bpe(min(args.vocab_size, model.config.vocab_size))
    # Strings without end: the constrained request decodes all its steps, as the free one does.
    schema = json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 100_000})
    grammar = Grammar(tokenizer, schema, model.config.vocab_size)
    free = SamplingParams(max_new_tokens=args.steps + 2, seed=0)
    constrained = SamplingParams(max_new_tokens=args.steps + 2, seed=0, json_schema=schema)
    _decode_ms(model, free, None, args.steps)  # warm-up: kernels, allocator
    runs = {"free": [], "constrained": []}
    for _ in range(args.repeats):  # interleaved, so that drift in the machine's speed hits both alike
        runs["free"].append(_decode_ms(model, free, None, args.steps))
        runs["constrained"].append(_decode_ms(model, constrained, grammar, args.steps))
    free_ms, constrained_ms = min(runs["free"]), min(runs["constrained"])
    return {
        "shape": args.shape,
        "vocab_size": tokenizer.vocab_size,
        "steps": args.steps,
        "free_ms": free_ms,
        "constrained_ms": constrained_ms,
        "ratio": constrained_ms / free_ms,
    }


def trained_byte_model(steps: int) -> GPT:
    """A tiny byte-level model trained for steps on the bundled corpus."""
    torch.manual_seed(0)
    data = torch.tensor(list(CORPUS.read_bytes()))
    model = GPT(ModelConfig(vocab_size=257, block_size=2048, n_layer=4, n_head=4, n_embd=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 129, (32,))
        batch = torch.stack([data[s : s + 129] for s in starts])
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 257), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def validity(args: argparse.Namespace) -> dict:
    import jsonschema

    tokenizer = ByteTokenizer()
    torch.manual_seed(0)
    started = time.perf_counter()
    models = {
        "random": GPT(ModelConfig(vocab_size=257, block_size=2048, n_layer=2, n_head=4, n_embd=64)).eval(),
        f"trained {args.train_steps} steps": trained_byte_model(args.train_steps),
    }
    print(f"trained the byte-level model in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    out = {}
    for name, model in models.items():
        valid, ends = 0, {}
        for index, schema in enumerate(SCHEMAS):
            params = SamplingParams(
                json_schema=json.dumps(schema), max_new_tokens=args.max_tokens, seed=index, num_samples=args.samples
            )
            texts, result = generate_text(model, tokenizer, ["JSON: "], params)
            for text, completion in zip(texts[0], result.completions[0]):
                ends[completion.finish_reason] = ends.get(completion.finish_reason, 0) + 1
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    pass
        total = len(SCHEMAS) * args.samples
        out[name] = {
            "schemas": len(SCHEMAS),
            "replies": total,
            "valid": valid,
            "valid_share": valid / total,
            "finish_reasons": ends,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "libraries", "cost", "validity"], default="all")
    parser.add_argument("--vocab-size", type=int, default=50257, help="BPE ids for the library comparison")
    parser.add_argument("--shape", default="gpt2", choices=sorted(PRESETS), help="model preset for the cost part")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per run (cost)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (cost; the fastest counts)")
    parser.add_argument("--samples", type=int, default=4, help="replies per schema (validity)")
    parser.add_argument("--max-tokens", type=int, default=1500, help="tokens per reply at most (validity)")
    parser.add_argument("--train-steps", type=int, default=300, help="training steps of the trained model")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    report: dict = {"cpu": library.capability(), "threads": torch.get_num_threads()}
    if args.part in ("all", "libraries"):
        report["libraries"] = libraries(args)
    if args.part in ("all", "cost"):
        report["cost"] = cost(args)
    if args.part in ("all", "validity"):
        report["validity"] = validity(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"cpu: {report['cpu']}, {report['threads']} threads")
    if "libraries" in report:
        lib = report["libraries"]
        print(f"\ngrammar libraries: {lib['vocab_size']}-id BPE, a {lib['document_tokens']}-token JSON document")
        print(f"{'library':<22} {'set-up s':>9} {'compile ms':>11} {'mask ms/token':>14} {'max ms':>8}")
        for row in lib["rows"]:
            if "error" in row:
                print(f"{row['library']:<22} {row['error']}")
            else:
                print(
                    f"{row['library']:<22} {row['setup_s']:>9.2f} {1000 * row['compile_s']:>11.1f} "
                    f"{row['mask_ms']:>14.3f} {row['mask_ms_max']:>8.2f}"
                )
    if "cost" in report:
        c = report["cost"]
        print(
            f"\ndecode per token, {c['shape']} batch 1 ({c['steps']} steps): free {c['free_ms']:.1f} ms, "
            f"constrained {c['constrained_ms']:.1f} ms = {c['ratio']:.3f}x"
        )
    if "validity" in report:
        print("\nreplies valid against their schema:")
        for name, row in report["validity"].items():
            print(
                f"  {name}: {row['valid']}/{row['replies']} ({100 * row['valid_share']:.1f}%) over "
                f"{row['schemas']} schemas; ends: {row['finish_reasons']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
