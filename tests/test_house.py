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
