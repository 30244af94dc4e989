"""The house's shape, checked so it cannot grow back: the benchmark scripts import one way, functions stay short."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"


def _local_imports(path: Path, local: set[str]) -> set[str]:
    """The sibling scripts a benchmark imports anywhere in its source (function-local imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found & local


def test_the_benchmark_scripts_import_each_other_one_way():
    scripts = {path.stem: path for path in BENCH_DIR.glob("*.py")}
    graph = {name: _local_imports(path, set(scripts)) for name, path in scripts.items()}
    assert "serve_process" in graph["serve_workloads"] and "serve_workloads" in graph["bench_serve"]

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
        return False

    assert not [name for name in graph if reaches(name, name)]


PACKAGE = ROOT / "gptkit"
MAX_FUNCTION_LINES = 60
# Functions past MAX_FUNCTION_LINES, each with why it stays whole (or who is splitting it). A new one fails the test.
LONG_FUNCTIONS = {
    "decoding/beam.py:beam_search": "one loop whose hypotheses, scores and cache rows move together each step",
    "decoding/api.py:complete": "decoding's entry point, being reshaped around DecodeOptions",
    "serving/metrics.py:Metrics.render": "the Prometheus exposition: one metric family after another, no logic",
    "serving/server.py:build_app": "the route table: one decorated handler per endpoint",
    "serving/completions.py:_completions": "the /v1/completions handler: validate, run, stream or answer in order",
    "cli/generate.py:register": "argparse flags, one call each",
    "cli/convert.py:register": "argparse flags, one call each",
    "cli/generate.py:run": "one command's steps in order (load, quantise, draft, template, decode, print)",
    "cli/eval.py:run": "one command's steps in order (load, choose the measure, score, print)",
    "cli/plan.py:run": "one command's steps in order (read, plan, print the table)",
    "checkpoint.py:save_checkpoint": "the write order that makes a checkpoint atomic, kept in one place to read",
    "formats/gguf/write.py:export_gguf": "the GGUF file's parts in the order written: keys, tokenizer, tensors",
}


def long_functions(root: Path = PACKAGE) -> dict[str, int]:
    """'file:Class.function' -> its length in lines (decorators left out) for every function under root past the
    bound, nested ones included."""
    found = {}

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{path}:{prefix}{child.name}"] = lines
                visit(child, path, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, path, f"{prefix}{child.name}.")
            else:
                visit(child, path, prefix)

    for file in sorted(root.rglob("*.py")):
        visit(ast.parse(file.read_text(encoding="utf-8")), file.relative_to(root).as_posix(), "")
    return found


def test_the_function_scan_finds_a_long_method_and_a_nested_function(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"class A:\n    def f(self):\n{body}\n\ndef g():\n    def h():\n{body}\n")
    assert long_functions(tmp_path) == {
        "m.py:A.f": MAX_FUNCTION_LINES + 1,
        "m.py:g": MAX_FUNCTION_LINES + 2,
        "m.py:g.h": MAX_FUNCTION_LINES + 1,
    }


def test_no_function_is_longer_than_the_bound_without_a_stated_reason():
    found = long_functions()
    assert not set(found) - set(LONG_FUNCTIONS), {name: found[name] for name in set(found) - set(LONG_FUNCTIONS)}


def private_uses(root: Path = PACKAGE) -> list[str]:
    """`from gptkit.x import _y` and `module._y` on an imported gptkit module, in every file under root."""
    found = []
    for file in sorted(root.rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gptkit"):
                found += [f"{file.name}: {alias.name}" for alias in node.names if _private(alias.name)]
                modules |= {alias.asname or alias.name for alias in node.names}
            elif isinstance(node, ast.Import):
                modules |= {alias.asname for alias in node.names if alias.name.startswith("gptkit") and alias.asname}
        found += [
            f"{file.name}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ]
    return found


def test_the_private_name_scan_finds_both_forms(tmp_path):
    (tmp_path / "m.py").write_text("from gptkit.a import _b, c\nimport gptkit.d as d\nd._e()\nc._f\nc.__name__\n")
    assert sorted(private_uses(tmp_path)) == ["m.py: _b", "m.py: c._f", "m.py: d._e"]


def test_no_private_name_is_used_across_gptkit_modules():
    """A name another module needs is public."""
    assert private_uses() == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
