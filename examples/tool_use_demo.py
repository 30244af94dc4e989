"""Tool use learnt from scratch, served, and driven by LangChain: a calculator, on a CPU in minutes.

1. Conversations: arithmetic questions ("What is 17 times 23?") answered by calling `calculator` with
   {"expression": "17*23"}, reading the tool's result and answering with it; other questions (greetings, "What
   colour is snow?", "I am 12 years old.") answered directly. Held out: number pairs, things, greetings and names
   never seen in training.
2. Each assistant turn becomes a prompt/completion row: the conversation before it rendered with gptkit's default
   chat template, the tools first (as `gptkit serve` renders a request), and the reply as the template writes it
   (a call as {"name": ..., "arguments": {...}}). The demo renders the conversations itself (it was written before
   "messages" rows could carry "tools" and "tool_calls"); such rows render the same turns (docs/finetune.md).
3. A small model trained from scratch on them (`gptkit prepare`, `gptkit train`).
4. `gptkit serve` on it, and an agent loop through LangChain's ChatOpenAI(...).bind_tools([calculator],
   parallel_tool_calls=False) with the default tool_choice (auto) on the held-out questions: how often it calls the
   tool when it should, answers directly when it should not, and answers right after the tool's result. (The
   model learnt one call a turn: parallel_tool_calls=False holds it to one; with OpenAI's default, true, a weak
   model may begin a second call after the first, which max_tokens then cuts short.)

Needs langchain-openai (pip install langchain-openai). Run: python examples/tool_use_demo.py [--out
runs/tool-use-demo] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator

from gptkit.chat import ChatTemplate
from gptkit.tokenizer import load_tokenizer

try:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai import ChatOpenAI
except ImportError:
    raise SystemExit("this demo drives the server through LangChain: pip install langchain-openai") from None

EOS = "<|endoftext|>"  # gptkit's BPE end-of-text text, which the default template ends replies with
# A small BPE vocabulary: the tools' JSON, the same in every prompt, becomes a few dozen tokens instead of 250 bytes
# (rows are a third as long as in bytes), while numbers stay digits and the held-out names split into pieces that
# training saw (with 1024 tokens, whole words of training become tokens and the held-out ones rarely seen pieces).
TOKENIZER = ["--tokenizer", "bpe", "--vocab-size", "384"]
MODEL = [
    "--model.n_layer",
    "3",
    "--model.n_head",
    "4",
    "--model.n_embd",
    "128",
    "--model.block_size",
    "160",
    "--model.position",
    "rope",
    "--model.dropout",
    "0.0",
]
TRAIN = [
    "--train.batch_size",
    "32",
    "--optim.lr",
    "3e-3",
    "--optim.min_lr",
    "3e-4",
    "--optim.warmup_steps",
    "30",
    "--train.eval_iters",
    "4",
    "--train.sample_every",
    "0",
    "--train.eval_examples",
    "8",
    "--train.eval_at_start",
    "false",
]

OPS = {"times": "*", "plus": "+", "minus": "-"}
ASK = ["What is {a} {op} {b}?", "How much is {a} {op} {b}?", "Compute {a} {op} {b}.", "What is {a}{sym}{b}?"]
COLOURS = {
    "the sky": "Blue",
    "grass": "Green",
    "snow": "White",
    "the sun": "Yellow",
    "coal": "Black",
    "blood": "Red",
    "the sea": "Blue",
    "milk": "White",
    "a banana": "Yellow",
    "a lemon": "Yellow",
    "a tomato": "Red",
    "a leaf": "Green",
    "an orange": "Orange",
    "chocolate": "Brown",
    "a cloud": "White",
    "a rose": "Red",
    "a frog": "Green",
    "a carrot": "Orange",
    "soil": "Brown",
    "ink": "Black",
    "a cherry": "Red",
    "a lime": "Green",
    "cream": "White",
    "a pumpkin": "Orange",
}
GREETINGS = [
    "Hi",
    "Hello",
    "Hello there",
    "Good morning",
    "Good evening",
    "Hey",
    "Hi there",
    "Greetings",
    "Howdy",
    "Good afternoon",
    "Hey there",
    "Morning",
    "Hiya",
    "Good day",
    "Yo",
    "Salut",
]
NAMES = [
    "Ada",
    "Alan",
    "Grace",
    "Linus",
    "Marie",
    "Isaac",
    "Emmy",
    "Niels",
    "Rosalind",
    "Carl",
    "Hedy",
    "Kurt",
    "Lise",
    "Paul",
    "Sofia",
    "Tim",
    "Barbara",
    "Claude",
    "Dorothy",
    "Edsger",
    "Frances",
    "Guido",
]


@tool
def calculator(expression: str) -> str:
    """Evaluate arithmetic, e.g. 17*23."""
    try:
        return str(_evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return f"error: {err}"


def _evaluate(node: ast.AST) -> int:
    """Integers, + - * and unary minus; anything else is refused (the model's text is never run)."""
    binary = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in binary:
        return binary[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only integers with + - * are supported")


def arithmetic(rng: random.Random, pairs: list[tuple[int, int, str]]) -> tuple[str, str]:
    """(question, expression) about one of the (a, b, op) triples."""
    a, b, op = rng.choice(pairs)
    return rng.choice(ASK).format(a=a, b=b, op=op, sym=OPS[op]), f"{a}{OPS[op]}{b}"


def direct(rng: random.Random, things: list[str], greetings: list[str], names: list[str]) -> tuple[str, str]:
    """(question, reply) that needs no tool."""
    kind = rng.randrange(5)
    if kind == 0:
        thing = rng.choice(things)
        return f"What colour is {thing}?", f"{COLOURS[thing]}."
    if kind == 1:
        return rng.choice(greetings) + rng.choice(["", "!", "."]), "Hello! How can I help?"
    if kind == 2:
        name = rng.choice(names)
        return f"My name is {name}.", f"Nice to meet you, {name}!"
    if kind == 3:
        return f"I am {rng.randrange(5, 90)} years old.", "Thank you for telling me."
    return rng.choice(["Thank you!", "Thanks.", "Thanks a lot!", "Thank you very much."]), "You are welcome."


def call_turns(question: str, expression: str) -> list[dict[str, Any]]:
    """A conversation in which the assistant calls the calculator and answers with its result."""
    arguments = {"expression": expression}
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    result = calculator.invoke(arguments)
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


def rows(conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One prompt/completion row per assistant turn: the text before it as `gptkit serve` renders a request, and
    the reply as the template writes it (its end-of-text left to prepare, which appends it)."""
    template, out = ChatTemplate(eos_token=EOS), []
    for i, message in enumerate(conversation):
        if message["role"] == "assistant":
            prompt = template.render(conversation[:i], tools=tools)
            whole = template.render(conversation[: i + 1], add_generation_prompt=False, tools=tools)
            out.append({"prompt": prompt, "completion": whole[len(prompt) :].split(EOS)[0]})
    return out


def splits(seed: int = 0) -> dict[str, Any]:
    """What training sees and what is held out: 10% of the number pairs, a quarter of the things, greetings and
    names."""
    rng = random.Random(seed)
    triples = [(a, b, op) for a in range(2, 100) for b in range(2, 100) for op in OPS]
    rng.shuffle(triples)
    split = {}
    for name, items in (("pairs", triples), ("things", sorted(COLOURS)), ("greetings", GREETINGS), ("names", NAMES)):
        items = list(items)
        rng.shuffle(items)
        cut = len(items) // 10 if name == "pairs" else len(items) // 4
        split[name] = (items[cut:], items[:cut])  # (train, held out)
    return split


def training_rows(split: dict[str, Any], conversations: int, tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Rows of `conversations` conversations, half of them calling the calculator."""
    rng, out = random.Random(1), []
    for n in range(conversations):
        if n % 2:
            out += rows(call_turns(*arithmetic(rng, split["pairs"][0])), tools)
        else:
            question, reply = direct(rng, split["things"][0], split["greetings"][0], split["names"][0])
            out += rows([{"role": "user", "content": question}, {"role": "assistant", "content": reply}], tools)
    rng.shuffle(out)
    return out


def gptkit_cli(*args: str) -> None:
    """Run one gptkit command, showing it as a user would type it."""
    print("$ gptkit " + shlex.join(args), file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "gptkit", *args], stdout=sys.stderr)
    if done.returncode:
        raise SystemExit(f"gptkit {args[0]} failed (exit {done.returncode}); its messages are above")


@contextmanager
def served(model_dir: Path, name: str) -> Iterator[str]:
    """`gptkit serve` on model_dir at a free local port, until the block ends; yields its /v1 URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = ["serve", str(model_dir), "--port", str(port), "--model-name", name]
    print("$ gptkit " + shlex.join(command), file=sys.stderr, flush=True)
    server = subprocess.Popen([sys.executable, "-m", "gptkit", *command], stdout=sys.stderr)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("gptkit serve did not start; its messages are above") from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


def ask(llm: Any, question: str) -> dict[str, Any]:
    """One agent turn: the model's reply, and where it calls tools, their results fed back until it answers."""
    messages: list[Any] = [HumanMessage(question)]
    expressions, prompt_tokens = [], None
    for _ in range(3):  # a model that keeps calling gets two more rounds, then its last reply stands
        reply = llm.invoke(messages)
        prompt_tokens = prompt_tokens or reply.usage_metadata["input_tokens"]
        if not reply.tool_calls:
            break
        messages.append(reply)
        for call in reply.tool_calls:
            expressions.append(call["args"].get("expression"))
            messages.append(ToolMessage(calculator.invoke(call["args"]), tool_call_id=call["id"]))
    return {"question": question, "calls": expressions, "answer": reply.content, "prompt_tokens": prompt_tokens}


def evaluate(
    url: str, name: str, split: dict[str, Any], count: int, tools: list[dict[str, Any]], tokenizer: Any
) -> dict[str, Any]:
    """The held-out figures: tool questions called and answered right, other questions answered directly."""
    llm = ChatOpenAI(
        model=name, base_url=url, api_key="unused", temperature=0, max_tokens=64, max_retries=0
    ).bind_tools([calculator], parallel_tool_calls=False)  # one call a turn, as it learnt (see the docstring)
    rng = random.Random(2)
    calls = [arithmetic(rng, split["pairs"][1]) for _ in range(count)]
    directs = [direct(rng, split["things"][1], split["greetings"][1], split["names"][1])[0] for _ in range(count)]
    with ThreadPoolExecutor(8) as pool:  # the server decodes concurrent requests in one batch (8 rows by default)
        called = list(pool.map(partial(ask, llm), [question for question, _ in calls]))
        answered = list(pool.map(partial(ask, llm), directs))
    check_prompt(answered[0], tools, tokenizer)
    right_call = [r["calls"][:1] == [e] for r, (_, e) in zip(called, calls)]
    right_answer = [r["answer"].strip() == f"The answer is {calculator.invoke(e)}." for r, (_, e) in zip(called, calls)]
    wrong = [r for r, ok in zip(called, right_answer) if not ok] + [r for r in answered if r["calls"]]
    return {
        "tool_questions": count,
        "called_when_needed": sum(bool(r["calls"]) for r in called) / count,
        "right_expression": sum(right_call) / count,
        "right_answer_after_tool": sum(right_answer) / count,
        "direct_questions": count,
        "answered_directly": sum(not r["calls"] for r in answered) / count,
        "examples": [called[0], answered[0]],
        "mistakes": wrong[:5],
    }


def check_prompt(result: dict[str, Any], tools: list[dict[str, Any]], tokenizer: Any) -> None:
    """Stop if the server's prompt for a question is not the text the model was trained on."""
    text = ChatTemplate(eos_token=EOS).render([{"role": "user", "content": result["question"]}], tools=tools)
    trained = len(tokenizer.encode(text))
    if result["prompt_tokens"] != trained:
        raise SystemExit(
            f"the server's prompt has {result['prompt_tokens']} tokens, the trained one {trained}: the "
            "tools render differently from the training rows"
        )


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    except OSError:
        return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tool-use-demo"), help="where everything is written")
    parser.add_argument("--quick", action="store_true", help="a fraction of the steps (a smoke run, not the result)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    steps, questions = (30, 10) if args.quick else (1000, 100)
    started = time.perf_counter()
    tools = [convert_to_openai_tool(calculator)]  # what bind_tools sends, so what the server renders
    split = splits()

    data, run, trained = out / "data", out / f"run-{steps}", None
    if (run / "latest").is_file():
        print(f"using the model trained before in {run}", file=sys.stderr)
    else:
        (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in training_rows(split, 8000, tools)))
        gptkit_cli(
            "prepare", "--input", str(out / "rows.jsonl"), *TOKENIZER, "--out", str(data), "--val-fraction", "0.02"
        )
        schedule = [
            "--train.max_steps",
            str(steps),
            "--train.eval_interval",
            str(steps),
            "--train.checkpoint_interval",
            str(steps),
        ]
        gptkit_cli("train", "--data", str(data), "--out", str(run), *MODEL, *TRAIN, *schedule, "--quiet")
        trained = round(time.perf_counter() - started)
    checkpoint = run / (run / "latest").read_text().strip()
    with served(checkpoint, "tool-demo") as url:
        figures = evaluate(url, "tool-demo", split, questions, tools, load_tokenizer(checkpoint))
    figures.update(
        cpu=cpu_name(),
        cores=os.cpu_count(),
        omp_threads=os.environ.get("OMP_NUM_THREADS"),
        train_steps=steps,
        train_seconds=trained,
        seconds=round(time.perf_counter() - started),
    )
    if args.json:
        print(json.dumps(figures))
        return 0
    threads = f", OMP_NUM_THREADS={figures['omp_threads']}" if figures["omp_threads"] else ""
    training = f"data and training {trained} s" if trained is not None else f"trained before, in {run}"
    print(
        f"\nheld-out questions on {figures['cpu']} ({figures['cores']} cores{threads}), {steps} training steps "
        f"({training}), {figures['seconds']} s in all:"
    )
    for key in ("called_when_needed", "right_expression", "right_answer_after_tool", "answered_directly"):
        count = figures["direct_questions" if key == "answered_directly" else "tool_questions"]
        print(f"  {key.replace('_', ' '):28s} {100 * figures[key]:5.1f}%  of {count}")
    for label, results in (("e.g.", figures["examples"]), ("wrong:", figures["mistakes"])):
        for result in results:
            print(f"  {label} {result['question']!r}: calls {result['calls']}, answer {result['answer']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
