"""The command blocks of the README and of every docs/ page, so that they cannot drift from the code (issues 44, 58).

The pages are read as one document, in a fixed order (PAGES, then any other docs/*.md by name): the README's first
hour, then the pages in the order a reader meets their subjects. Every `gptkit` command in a ```bash block must parse
with gptkit's own parser (and a train command's settings must resolve), every script and make target it names must
exist, and every path a command reads must be made by an earlier command (on this page or an earlier one), be a file
of the repository, or be one of the user's own inputs the pages only illustrate (USER_INPUTS, placeholders such as
MODEL_DIR). The commands that run on a CPU and need no trained model run for real in the default suite, in order, in
a temporary directory; the rest (training, and everything on a trained model) run for real in the slow suite. Every
```python block compiles, and every link between the pages, to their headings and to the repository's files resolves.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gptkit.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The order the pages' commands run in: a page may read what an earlier one made (docs/train.md trains the model
# that docs/generate.md samples from). Pages not listed run after these, by name.
PAGES = (
    "README.md",
    "docs/getting-started.md",
    "docs/prepare.md",
    "docs/train.md",
    "docs/watch.md",
    "docs/finetune.md",
    "docs/preference.md",
    "docs/rl.md",
    "docs/generate.md",
    "docs/eval-inspect.md",
    "docs/convert.md",
    "docs/serve.md",
    "docs/python-api.md",
    "docs/gpu.md",
    "docs/benchmarks.md",
    "docs/architecture.md",
    "docs/spec.md",
)
# Files and directories the README's examples read that only the user has (their data, a downloaded model).
USER_INPUTS = {
    "my_code",
    "docs.jsonl",
    "shard-000.jsonl.gz",
    "shard-001.jsonl.zst",
    "train-00000-of-00004.parquet",
    "reviews.csv",
    "more.txt",
    "latin1_mess",
    "chats.jsonl",
    "pairs.jsonl",
    "reviews.jsonl",
    "p.txt",
    "person.schema.json",
    "text.txt",
    "my-config.json",
    "gpt2",
    "my_text.txt",
    "data/openwebtext",
}  # fmt: skip  (the GPU recipe's corpus, a download)
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)+|MODEL|TASKS")  # MODEL_DIR, LLAMA_CPP/build/bin, ...
NEEDS_A_GPU = re.compile(r"--device cuda|gpt2-124m|--nproc_per_node 8|bench_gpu|gpu_check|-m device")
# Programs that only a person at a terminal with other software runs (a GPU, llama.cpp, a download, a browser).
NOT_RUN = ("llama-simple", "pip", "tar", "cmake", "cd", "curl", "lm_eval", "make", "scripts/gpu_check.sh")


@dataclass
class Command:
    """One command of a page's block: its words, the page and line it starts on, and what the block around it is."""

    words: list[str]
    line: int
    text: str
    stdout: str | None = None  # a `> FILE` redirection
    stdin: str | None = None  # the text an `echo ... |` feeds it
    page: str = "README.md"
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    runnable: bool = True  # a CPU runs it as written, on what earlier runnable commands made
    slow: bool = False  # it trains, or needs what a training made

    @property
    def where(self) -> str:
        """The page and line, as a failure names them."""
        return f"{self.page} line {self.line}"

    @property
    def key(self) -> tuple:
        """What makes two commands the same (pages repeat one with another comment): each is run once."""
        return (*self.words, self.stdout, self.stdin)


def _ansi_c(text: str) -> str:
    """bash's $'...' strings as plain single-quoted ones, which shlex reads."""
    return re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(codecs.decode(m.group(1), "unicode_escape")), text)


def bash_blocks(page: str, language: str = "bash") -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each ```bash block (or of another language's)."""
    lines, blocks, start = page.split("\n"), [], None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == f"```{language}":
            start = number
        elif start is not None and line.strip() == "```":
            blocks.append((start + 1, lines[start : number - 1]))
            start = None
    return blocks


def commands(source: str, page: str = "README.md") -> list[Command]:
    """Every command of every bash block of a page, in order: continuation lines joined, comments dropped, pipes and
    `&&` split, a `> FILE` redirection and an `echo TEXT |` kept apart."""
    found = []
    for first, lines in bash_blocks(source):
        buffer, start = "", first
        for number, line in enumerate(lines, first):
            if not buffer:
                start = number
            buffer += line.removesuffix("\\") + ("\n" if not line.endswith("\\") else " ")
            if line.endswith("\\"):  # continued on the next line
                continue
            try:
                words = shlex.split(_ansi_c(buffer), comments=True)
            except ValueError:  # a quotation still open: the command goes on
                continue
            text, buffer = buffer.strip(), ""
            stdin = None
            for part in _split(words, ("&&",)):
                pieces = list(_split(part, ("|",)))
                if len(pieces) == 2 and pieces[0][:1] == ["echo"]:
                    stdin, part = " ".join(pieces[0][1:]) + "\n", pieces[1]
                if not part:
                    continue
                stdout = part[part.index(">") + 1] if ">" in part else None
                part = part[: part.index(">")] if ">" in part else part
                found.append(Command(part, start, text, stdout, stdin, page=page))
    return found


def _split(words: list[str], separators: tuple[str, ...]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for word in words:
        if word in separators:
            parts.append([])
        else:
            parts[-1].append(word)
    return parts


def gptkit_argv(command: Command) -> list[str] | None:
    """The arguments of a gptkit command (also under torchrun), or None."""
    words = command.words
    if words[0] == "gptkit":
        return words[1:]
    if words[0] == "torchrun" and "-m" in words and words[words.index("-m") + 1] == "gptkit":
        return words[words.index("-m") + 2 :]
    return None


def _known(path: str | None, made: set[str]) -> bool:
    """Whether a path a command reads is made earlier, in the repository, the user's own, or a placeholder."""
    if path is None:
        return True
    clean = path.rstrip("/")
    return clean in made or (ROOT / clean).exists() or _placeholder_or_user(clean)


def _placeholder_or_user(path: str) -> bool:
    """A path only the user has (USER_INPUTS) or a placeholder the README asks them to fill in."""
    clean = path.rstrip("/")
    first = clean.split("/")[0]
    return clean in USER_INPUTS or first in USER_INPUTS or bool(PLACEHOLDER.fullmatch(first))


def _train_paths(args, runs: dict[str, object]) -> tuple[list[str], list[str]]:
    """(paths read, paths made) of a `gptkit train`: the data, the model it starts from, the run resumed; the run
    directory and the checkpoints the run keeps."""
    from gptkit.cli.train import ALIASES
    from gptkit.run_sources import flag_overrides, from_sources

    flags = flag_overrides(args)
    for option, key in ALIASES.items():
        if getattr(args, option) is not None:
            section, name = key.split(".")
            flags.setdefault(section, {})[name] = getattr(args, option)
    if args.resume_from:
        flags.setdefault("train", {})["out_dir"] = str(Path(args.resume_from).parent.parent)
    resumed = args.resume or args.resume_from
    out = flags.get("train", {}).get("out_dir")
    if resumed and out in runs:  # the run's own settings, then the flags that may change on a resume
        config = runs[out]
        config.train.max_steps = flags.get("train", {}).get("max_steps", config.train.max_steps)
    else:
        config = from_sources(ROOT / args.config if args.config else None, flags)
    if config.train.out_dir is None:
        config.train.out_dir = str(Path("runs") / Path(args.config).stem)
    run = config.train.out_dir.rstrip("/")
    runs[run] = config
    t = config.train
    steps = sorted({*range(t.checkpoint_interval, t.max_steps + 1, t.checkpoint_interval), t.max_steps})
    kept = steps[-t.keep_checkpoints :]
    reads = [t.data_dir, config.model.init_from] + ([run] if resumed else []) + [args.resume_from]
    return [p for p in reads if p], [run, f"{run}/latest", *(f"{run}/checkpoints/step-{s:06d}" for s in kept)]


def plan(pages: list[tuple[str, str]]) -> list[Command]:
    """The commands of the pages ((name, text), in order), each parsed (a parse error fails the test naming the page
    and line) with what it reads and makes, whether a CPU runs it as written and whether it is slow."""
    made: set[str] = set()
    real: set[str] = set()  # made by commands that run
    slow: set[str] = set()  # made by slow commands
    runs: dict[str, object] = {}
    planned = []
    for command in (c for name, text in pages for c in commands(text, name)):
        argv = gptkit_argv(command)
        if argv is not None:
            _gptkit_paths(command, argv, runs)
        elif command.words[0] == "python":
            _python_paths(command, made)
        else:
            _other_program(command)
        command.inputs, command.outputs = [str(p) for p in command.inputs], [str(p) for p in command.outputs]
        missing = [p for p in command.inputs if not _known(p, made)]
        assert not missing, f"{command.where}: {command.text!r} reads {missing[0]}, which nothing before makes"
        placeholders = [p for p in command.inputs if _placeholder_or_user(p)]
        command.runnable = (
            command.runnable
            and not placeholders
            and not NEEDS_A_GPU.search(command.text)
            and all(p.rstrip("/") in real or (ROOT / p.rstrip("/")).exists() for p in command.inputs)
        )
        command.slow = command.slow or any(p.rstrip("/") in slow for p in command.inputs)
        if command.outputs and argv is not None and argv[0] == "train":  # the checkpoints it prunes are gone
            gone = {p for p in made if p.startswith(f"{command.outputs[0]}/checkpoints/")} - set(command.outputs)
            made -= gone
            real -= gone
        made.update(p.rstrip("/") for p in command.outputs)
        if command.runnable:
            real.update(p.rstrip("/") for p in command.outputs)
        if command.slow:
            slow.update(p.rstrip("/") for p in command.outputs)
        planned.append(command)
    return planned


def _other_program(command: Command) -> None:
    """Any other program: a make target or a script must exist; only printf and grep (making a file) run here."""
    program = command.words[0]
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert command.words[1] in targets, f"{command.where}: no make target {command.words[1]}"
    elif "/" in program:
        assert (ROOT / program).exists(), f"{command.where}: {program} does not exist"
    command.runnable = program in ("printf", "grep")  # they make a page's input files
    command.outputs = [command.stdout] if command.stdout else []


@functools.cache
def _parser(name: str):
    """gptkit's parser with one command's flags, built once per command (train's takes a second: every setting)."""
    return build_parser(full=[name])


def _gptkit_paths(command: Command, argv: list[str], runs: dict[str, object]) -> None:
    """Parse a gptkit command as `gptkit` would and note the paths it reads and makes."""
    name = argv[0]
    parser = _parser(name)
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit:
        pytest.fail(f"{command.where}: {command.text!r} does not parse")
    assert not unknown, f"{command.where}: {command.text!r}: unknown {unknown}"
    if name == "train":
        command.inputs, command.outputs = _train_paths(args, runs)
        command.slow = True
        return
    if name == "generate":
        from gptkit.cli.flags import dataclass_from_args
        from gptkit.decoding.sampling import SamplingParams

        dataclass_from_args(SamplingParams, args)  # its ranges, as generate checks them first
    if name == "prepare":
        tokenizer = getattr(args, "tokenizer", "char")
        command.inputs = list(getattr(args, "inputs", None) or [])
        command.inputs += [tokenizer] if tokenizer not in ("char", "byte", "bpe") else []
        command.outputs = [args.out]
    elif name in ("generate", "eval", "inspect", "serve", "classify"):
        command.inputs = [
            args.model_dir,
            getattr(args, "data", None),
            getattr(args, "input", None),
            getattr(args, "prompt_file", None) and str(args.prompt_file),
        ]
        command.inputs = [p for p in command.inputs if p]
        command.outputs = [args.out] if name == "inspect" else []
    elif name == "convert":
        source = args.to_gguf or args.to_hf or args.merge or args.from_gguf or args.from_hf
        command.inputs, command.outputs = [source], [args.out]
    elif name == "info" and ("/" in args.model or args.model.endswith(".json")):
        command.inputs = [args.model]  # a file or directory, not a preset


def _python_paths(command: Command, made: set[str]) -> None:
    """A `python ...` command: the script must exist (examples take their own options), `-c` code must compile and
    reads the paths it quotes: a data set's, or any an earlier command made."""
    words = command.words
    if words[1] == "-c":
        compile(words[2], f"{command.where}", "exec")
        quoted = re.findall(r"'([\w][\w./-]*)'", words[2])
        command.inputs = [q for q in quoted if q.startswith("data/") or q.rstrip("/") in made]
        return
    if words[1] == "-m":
        command.runnable = False
        return
    script = ROOT / words[1]
    assert script.is_file(), f"{command.where}: {words[1]} does not exist"
    if words[1] != "examples/watch_it_learn.py":
        command.runnable = False  # benchmarks and demonstrations: timed runs of their own
        return
    spec = importlib.util.spec_from_file_location("watch_it_learn", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.build_parser().parse_args(words[2:])
    command.inputs = [str(args.out)] if args.plot_only else []
    command.outputs = [str(args.out), str(module.DATA)]
    command.slow = True


def page_names() -> list[str]:
    """The pages in the order their commands run: PAGES, then any other docs/*.md by name."""
    others = sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in PAGES)
    return [name for name in PAGES if (ROOT / name).is_file()] + others


@functools.cache
def docs_plan() -> tuple[Command, ...]:
    """The pages' commands, planned once per session (see plan), parsed where the user's own files exist as
    stand-ins (a JSON schema is read as its flag is parsed)."""
    pages = [(name, (ROOT / name).read_text()) for name in page_names()]
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        Path("person.schema.json").write_text('{"type": "object"}')
        return tuple(plan(pages))


def test_every_command_parses_and_reads_only_what_came_before():
    assert set(PAGES) <= set(page_names()), f"missing pages: {sorted(set(PAGES) - set(page_names()))}"
    gptkit_commands = [c for c in docs_plan() if gptkit_argv(c) is not None]
    assert len(gptkit_commands) > 80
    first_hour = [c.text for c in docs_plan() if c.runnable and c.page == "README.md"]
    assert first_hour[:3] == [
        "gptkit prepare --tokenizer char --out data/shakespeare_char",
        "gptkit train --config configs/shakespeare-char-cpu.yaml",
        'gptkit generate runs/shakespeare-char-cpu/checkpoints/step-002000 --prompt "ROMEO:" --max-new-tokens 200',
    ]
    gguf = [c for c in docs_plan() if "--to-gguf" in c.words or "--from-gguf" in c.words]
    assert gguf and all(c.runnable for c in gguf)  # made by the pages' own commands, on a CPU


def test_the_readme_stays_short_and_runs_its_tests_as_ci_does():
    """The README is a guide, not the manual (issue 58): the rest lives in docs/; CI runs its test command."""
    readme = README.read_text()
    assert len(readme.split("\n")) <= 300
    assert "make test" in [c.text.split("#")[0].strip() for c in commands(readme)]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readmes_table_names_every_command():
    """The README's command-to-page table sends a reader to the page of every `gptkit` command."""
    from gptkit.cli import COMMANDS

    rows = [line for line in README.read_text().split("\n") if line.startswith("|") and "](docs/" in line]
    assert not [name for name in COMMANDS if not any(f"`gptkit {name}" in row for row in rows)]


def test_every_python_block_compiles():
    for name in page_names():
        for first, lines in bash_blocks((ROOT / name).read_text(), "python"):
            compile("\n".join(lines), f"{name} line {first}", "exec")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (outside code blocks), a repeated heading's with -1, -2, ... as GitHub numbers
    them."""
    found: set[str] = set()
    fenced = False
    for line in text.split("\n"):
        fenced ^= line.strip().startswith("```")
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not fenced:
            base, n = slug(heading.group(1)), 0
            while (anchor := base if n == 0 else f"{base}-{n}") in found:
                n += 1
            found.add(anchor)
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every markdown link and image outside code blocks and code spans."""
    found, fenced = [], False
    for number, line in enumerate(text.split("\n"), 1):
        fenced ^= line.strip().startswith("```")
        if not fenced:
            prose = re.sub(r"`[^`]*`", "", line)
            found += [(number, target) for target in re.findall(r"\]\(([^)\s]+)\)", prose)]
    return found


def test_links_between_pages_and_to_the_repository_resolve():
    """Every relative link names a file of the repository, and an anchor names a heading of its page."""
    broken = []
    for name in page_names():
        page = ROOT / name
        for line, target in links(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or not resolved.is_relative_to(ROOT):
                broken.append(f"{name} line {line}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                broken.append(f"{name} line {line}: {target} (no heading #{anchor} in {resolved.name})")
    assert not broken, "\n".join(broken)


def test_the_repository_files_the_pages_name_exist():
    """A file named in code spans (`gptkit/serving/app.py`, `tests/serving/test_serve_api.py`) is there: files move."""
    named = re.compile(r"\b(?:gptkit|benchmarks|examples|configs|scripts|tests)/[\w./-]*\w")
    missing = []
    for name in page_names():
        for number, line in enumerate((ROOT / name).read_text().split("\n"), 1):
            for span in re.findall(r"`([^`]+)`", line):
                missing += [f"{name} line {number}: {p}" for p in named.findall(span) if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


def test_every_cited_spec_section_exists():
    """Code cites the model's math as "docs/spec.md section N" (or N.M): each such section is a heading there."""
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", (ROOT / "docs" / "spec.md").read_text(), re.MULTILINE))
    cited = []
    for folder in ("gptkit", "tests", "benchmarks", "examples", "docs"):
        for path in (ROOT / folder).rglob("*.py" if folder != "docs" else "*.md"):
            for section in re.findall(r"spec\.md section (\d+(?:\.\d+)?)", path.read_text(errors="replace")):
                cited.append((path.relative_to(ROOT), section))
    assert cited and "3.2" in headings
    assert not [c for c in cited if c[1] not in headings], [c for c in cited if c[1] not in headings]


def test_no_file_refers_outside_the_repository():
    """A clone holds everything its files cite (issue 58): no path above the repository, no cited file outside it."""
    outside = re.compile(r"\.\./" + "shared/|SPEC" + r" section \d|SPEC" + r"\.md")  # split: this file would match
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".yaml", ".toml", ".cpp", ".h", ".sh", ".txt", "") and path.is_file():
            text = path.read_text(errors="replace")
            found += [f"{name}: {m.group(0)}" for m in outside.finditer(text)]
    assert not found, "\n".join(found)


def test_the_anchor_rule_is_githubs():
    assert slug("`gptkit serve` — an OpenAI-compatible HTTP server") == "gptkit-serve--an-openai-compatible-http-server"
    assert slug("llama.cpp: GGUF out and in") == "llamacpp-gguf-out-and-in"
    assert anchors("# A\n```\n# not a heading\n```\n## A") == {"a", "a-1"}


def run_command(command: Command, cwd: Path) -> None:
    """Run one command of a page as a person types it, in cwd, with this interpreter's gptkit first on the PATH."""
    if command.words[:2] == ["gptkit", "serve"]:
        return _serve(command, cwd)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    words = [sys.executable, *command.words[1:]] if command.words[0] == "python" else command.words
    if words[1:2] and words[1].startswith("examples/"):
        words[1] = str(ROOT / words[1])
    stdout = open(cwd / command.stdout, "w") if command.stdout else subprocess.PIPE
    with stdout if command.stdout else contextlib.nullcontext():
        done = subprocess.run(
            words, cwd=cwd, env=env, input=command.stdin, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=3600
        )
    assert done.returncode == 0, f"{command.where}: {command.text!r} failed:\n{done.stderr[-2000:]}"


def _serve(command: Command, cwd: Path) -> None:
    """Start `gptkit serve` as written, wait until it answers /health, then stop it (Ctrl-C)."""
    import httpx

    server = subprocess.Popen(
        [sys.executable, "-m", "gptkit", *command.words[1:]], cwd=cwd, stderr=subprocess.PIPE, text=True
    )
    try:
        for _ in range(600):
            if server.poll() is not None:
                err = server.stderr.read()
                if "cannot listen on" in err:
                    pytest.skip(f"{command.where}: its port is taken on this machine")
                pytest.fail(f"{command.where}: {command.text!r} exited:\n{err[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get("http://127.0.0.1:8000/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.5)
        pytest.fail(f"{command.where}: the server never answered /health")
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)


def _link_repository(cwd: Path) -> None:
    """The repository's files the commands read (recipes, the bundled corpus), in the fresh directory."""
    for name in ("configs", "gptkit", "examples", "benchmarks"):
        (cwd / name).symlink_to(ROOT / name)


def test_the_fast_cpu_commands_run_as_written(tmp_path, monkeypatch):
    """The commands that need no training, in order, in a fresh directory (gptkit's in this process)."""
    _link_repository(tmp_path)
    monkeypatch.chdir(tmp_path)
    ran, seen = 0, set()
    for command in docs_plan():
        if not command.runnable or command.slow or command.key in seen:
            continue
        seen.add(command.key)
        argv = gptkit_argv(command)
        if argv is not None and command.stdin is None and command.words[0] == "gptkit":
            assert main(argv) == 0, f"{command.where}: {command.text!r}"
        else:
            run_command(command, tmp_path)
        ran += 1
    assert ran >= 8 and (tmp_path / "data" / "prompts" / "meta.json").is_file()


@pytest.mark.slow
def test_the_pages_cpu_commands_run_as_written_in_order(tmp_path):
    """Every command a CPU runs as written, in the pages' order, in a fresh directory: the trainings and what the
    pages do with their models (a command repeated is run once)."""
    _link_repository(tmp_path)
    seen: set[tuple] = set()
    for command in docs_plan():
        if command.runnable and command.key not in seen:
            run_command(command, tmp_path)
            seen.add(command.key)
