"""gptkit's modules import one way: no import cycle (function-local imports count), and each imports on its own."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gptkit"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules an import statement loads (the longest known prefix of each name)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(max(node.level - 1, 0)):
            base = base.rpartition(".")[0]
        source = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
        names = [source] + [f"{source}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports anywhere in its source: inside functions too, and for type hints only (under
    `if TYPE_CHECKING:`), since a reader follows those as well and a hint-only import hides a dependency as much as
    a function-local one."""
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        graph[module] = set().union(
            *[_targets(node, module, path.name == "__init__.py", set(files)) for node in imports]
        )
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_gptkit():
    graph = import_graph()
    assert "gptkit.decoding.batch" in graph and "gptkit.decoding.step" in graph["gptkit.decoding.batch"]
    assert cycles(graph) == []


def _imported_by_name(tree: ast.AST) -> set[str]:
    """Module names a source imports by string (importlib.import_module("x"), __import__("x"))."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def test_each_format_module_imports_no_other_format_and_nothing_imports_loading_from_below():
    graph = import_graph()
    root = PACKAGE / "formats"
    files = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))  # a format is a module or a package of them
    formats = {_module(path) for path in files if path.parent == root and path.name != "__init__.py"} | {
        _module(path) for path in root.glob("*/__init__.py")
    }
    assert {
        "gptkit.formats.gguf",
        "gptkit.formats.hf",
        "gptkit.formats.lora",
        "gptkit.formats.modeldir",
        "gptkit.formats.quantized",
    } <= formats
    above = ("gptkit.loading", "gptkit.finetune", "gptkit.train", "gptkit.cli", "gptkit.serving")

    def format_of(module: str) -> str:  # gptkit.formats.hf.tokenizer belongs to gptkit.formats.hf
        return ".".join(module.split(".")[:3])

    for path in files:  # every file, its function-local imports and string imports included
        module = _module(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        by_name = {name for name in _imported_by_name(tree) if name.startswith("gptkit.")}
        imported = graph[module] | by_name
        others = {
            m
            for m in imported
            if (m == "gptkit.formats" or m.startswith("gptkit.formats.")) and format_of(m) != format_of(module)
        }
        if path == root / "__init__.py":
            others -= formats | {"gptkit.formats"}  # the package may name its modules (it names none today)
        assert not others, f"{module} imports another format: {sorted(others)}"
        assert not {m for m in imported if m.startswith(above)}, f"{module} imports from above the formats"
    assert "gptkit.loading" in graph["gptkit.cli.generate"] and "gptkit.loading" not in graph["gptkit.model"]


def test_the_neutral_modules_import_nothing_above_them():
    graph = import_graph()
    above = ("gptkit.formats", "gptkit.finetune", "gptkit.loading", "gptkit.train", "gptkit.cli", "gptkit.serving")
    for module in ("gptkit.tensors", "gptkit.weights", "gptkit.adapters"):
        assert not {m for m in graph[module] if m.startswith(above)}, module
    assert "gptkit.adapters" not in graph["gptkit.model"]  # adapters wrap the model's layers from outside
    assert "gptkit.tensors" in graph["gptkit.formats.modeldir"] and "gptkit.tensors" in graph["gptkit.tokenizer.files"]


def test_decoding_imports_flow_one_way():
    graph = import_graph()
    assert not {m for m in graph["gptkit.model"] if m.startswith(("gptkit.decoding", "gptkit.serving"))}
    order = [
        "gptkit.decoding.sampling",
        "gptkit.decoding.step",
        "gptkit.decoding.kv_store",
        "gptkit.decoding.prefix_cache",
        "gptkit.decoding.request",
        "gptkit.decoding.verify",
        "gptkit.decoding.lookup",
        "gptkit.decoding.batch",
        "gptkit.decoding.beam",
        "gptkit.decoding.speculative",
        "gptkit.decoding.api",
    ]
    for i, module in enumerate(order):
        assert not graph[module] & set(order[i + 1 :]), module  # nothing above it
    # The engine drives the batch engine; it also holds the prefix cache it hands it (to report on it and close it)
    # and the lookup settings requests speculate with.
    assert not {
        m
        for m in graph["gptkit.serving.engine"]
        if m.startswith("gptkit.decoding.")
        and m
        not in (
            "gptkit.decoding.batch",
            "gptkit.decoding.request",
            "gptkit.decoding.prefix_cache",
            "gptkit.decoding.lookup",
        )
    }


def test_every_module_imports_on_its_own():
    """Each module imported first, in a fresh set of gptkit modules (torch stays loaded to keep this quick)."""
    modules = sorted(m for m in import_graph() if m != "gptkit.__main__")
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'gptkit' or m.startswith('gptkit.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as err:\n"
        "        failed.append(f'{name}: {type(err).__name__}: {err}')\n"
        "print('\\n'.join(failed))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_training_loop_names_no_method_or_objective():
    """gptkit/train.py knows methods and objectives only through gptkit.finetune's interfaces: no name of one is
    compared, imported or built there (a new one is a file in gptkit/finetune and a line in its catalogue)."""
    from gptkit.finetune.catalogue import METHODS, OBJECTIVES

    source = (PACKAGE / "train.py").read_text()
    for name in [*METHODS, *OBJECTIVES]:
        assert f'"{name}"' not in source and f"'{name}'" not in source, name
    for cls in [*METHODS.values(), *OBJECTIVES.values()]:
        assert cls.__name__ not in source, cls.__name__
    graph = import_graph()
    assert {m for m in graph["gptkit.train"] if m.startswith("gptkit.finetune")} == {
        "gptkit.finetune.catalogue",
        "gptkit.finetune.parts",
    }


def _under(module: str, packages: tuple[str, ...]) -> bool:
    """Whether module is one of packages or inside one (gptkit.train is not gptkit.train_config)."""
    return any(module == p or module.startswith(p + ".") for p in packages)


# The floors below the training loop: what each may never import, hint-only imports included. The run's settings
# are data the method catalogue's parts name in their hints, so they import no part; composing them from YAML and
# flags (gptkit.run_sources) sits above the catalogue.
ABOVE_THE_MODEL = (
    "gptkit.train",
    "gptkit.run_sources",
    "gptkit.finetune",
    "gptkit.decoding",
    "gptkit.formats",
    "gptkit.loading",
    "gptkit.serving",
    "gptkit.cli",
    "gptkit.observe",
)
LAYER_RULES = {
    (
        "gptkit.config",
        "gptkit.presets",
        "gptkit.positions",
        "gptkit.layers",
        "gptkit.attention",
        "gptkit.model",
        "gptkit.kv_cache",
        "gptkit.loss",
        "gptkit.errors",
    ): ABOVE_THE_MODEL,
    ("gptkit.settings", "gptkit.train_config", "gptkit.optim"): (
        "gptkit.train",
        "gptkit.run_sources",
        "gptkit.finetune",
        "gptkit.cli",
    ),
    ("gptkit.finetune",): ("gptkit.train", "gptkit.run_sources", "gptkit.cli"),
}


def test_each_floor_imports_nothing_above_it_hint_only_imports_included():
    graph = import_graph()
    assert "gptkit.train_config" in graph["gptkit.finetune.parts"]  # a hint-only import is counted
    for floor, forbidden in LAYER_RULES.items():
        for module in (m for m in graph if _under(m, floor)):
            assert not {m for m in graph[module] if _under(m, forbidden)}, module


def _gptkit_modules_loaded_by(names: list[str]) -> dict[str, list[str]]:
    """The gptkit modules that importing each of names loads, each imported first in a fresh set of gptkit modules
    (one process: torch stays loaded to keep this quick)."""
    script = (
        "import importlib, json, sys\n"
        "loaded = {}\n"
        f"for name in {names!r}:\n"
        "    for module in [m for m in sys.modules if m.split('.')[0] == 'gptkit']:\n"
        "        del sys.modules[module]\n"
        "    importlib.import_module(name)\n"
        "    loaded[name] = sorted(m for m in sys.modules if m.split('.')[0] == 'gptkit')\n"
        "print(json.dumps(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_importing_the_optimiser_or_the_model_loads_few_gptkit_modules():
    """The optimiser needs its settings, not the method catalogue they were once composed with; the model needs its
    layers and the products they call, not the kernels' build machinery (ops imports it on the first product)."""
    loaded = _gptkit_modules_loaded_by(["gptkit.optim", "gptkit.model"])
    optim, model = loaded["gptkit.optim"], loaded["gptkit.model"]
    assert not [m for m in optim if _under(m, ("gptkit.finetune", "gptkit.train", "gptkit.run_sources"))]
    # Its settings, the LoRA adapters it leaves to AdamW, and what they import: not the model, whose layers import
    # gptkit.native.ops (optim and adapters import the model's classes where they look for them).
    assert not [m for m in optim if _under(m, ("gptkit.model", "gptkit.native"))]
    assert len(optim) <= 15
    assert not [m for m in model if _under(m, ABOVE_THE_MODEL)]
    assert [m for m in model if _under(m, ("gptkit.native",))] == ["gptkit.native", "gptkit.native.ops"]
    assert len(model) <= 15  # 13 today: the model layer's ten, gptkit, and the two of gptkit.native
