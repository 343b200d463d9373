"""The package's layout: imports run one way (docs/architecture.md, "Layout").

Every import in ``safeformer/`` is read from the source (module level, inside functions, and under
``TYPE_CHECKING``), so a lazy import or an annotation-only import that goes the wrong way fails here too.
The subpackages form layers; a module may import its own layer and the layers below it, never above,
and no group of modules imports itself in a circle. The top-level modules (``safeformer/*.py``) sit above
every layer: the package's door (``__init__``), its tools (``testing``, ``debug``) and x-transformers'
import paths, which only re-export.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "safeformer"
LAYERS = ("core", "checkpoints", "nn", "stack", "decoding", "interop", "research")
# top-level modules that implement something; every other top-level module only re-exports
TOOLS = ("__init__", "testing", "debug")


def module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> str:
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> set[str]:
    """The package's modules (and packages) that ``path`` imports, anywhere in it."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        else:
            continue
        out |= {f for f in found if f == root.name or f.startswith(root.name + ".")}
    return out


def import_graph(root: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        # an import of a package reaches its __init__; an import of a name in a module reaches that module
        graph[mod] = {t for t in imports_of(path, root) if t in files and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_of(mod: str) -> int:
    parts = mod.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in graph.items() for t in ts if layer_of(t) > layer_of(m))


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_imports_run_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_every_subpackage_is_a_layer():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(LAYERS)


def test_top_level_modules_only_re_export():
    """x-transformers' import paths (``safeformer.attend``, ``safeformer.x_transformers``, ...) are thin: imports and
    constants, no function or class defined there."""
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem in TOOLS:
            continue
        defined = [n.name for n in ast.parse(path.read_text()).body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        assert defined == [], f"{path.name} defines {defined}: implement it in a subpackage and re-export it"


def test_layers_never_import_the_top_level():
    graph = import_graph()
    top = {m for m in graph if layer_of(m) == len(LAYERS)}
    wrong = sorted((m, t) for m, ts in graph.items() if layer_of(m) < len(LAYERS) for t in ts if t in top
                   and t != "safeformer")
    assert wrong == []


# the checks themselves, on a made-up package: each must catch what it is for


def _fake_package(tmp_path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "safeformer"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("where", ["module", "function", "type_checking"])
def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path, where):
    lazy = {"module": "from ..stack.layers import Stack\n",
            "function": "def f():\n    from ..stack.layers import Stack\n",
            "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..stack import layers\n"}
    root = _fake_package(tmp_path, {
        "__init__.py": "", "core/__init__.py": "", "stack/__init__.py": "",
        "core/masks.py": lazy[where],
        "stack/layers.py": "from ..core.masks import x\nclass Stack: ...\n",
    })
    graph = import_graph(root)
    assert "safeformer.stack.layers" in graph["safeformer.core.masks"]
    assert cycles(graph) == [["safeformer.core.masks", "safeformer.stack.layers"]]
    assert ("safeformer.core.masks", "safeformer.stack.layers") in upward_imports(graph)


def test_the_checks_pass_a_clean_package(tmp_path):
    root = _fake_package(tmp_path, {
        "__init__.py": "from .stack.layers import Stack\n", "core/__init__.py": "", "stack/__init__.py": "",
        "core/masks.py": "import torch\n", "stack/layers.py": "from ..core import masks\n",
    })
    graph = import_graph(root)
    assert cycles(graph) == [] and upward_imports(graph) == []
    assert graph["safeformer.stack.layers"] == {"safeformer.core", "safeformer.core.masks"}


def test_the_attend_function_keeps_its_name_after_the_module_path_is_imported():
    import safeformer
    import safeformer.attend  # noqa: F401  (x-transformers' path: the module)
    from safeformer.attend import Attend, attend

    assert callable(safeformer.attend) and safeformer.attend is attend
    assert Attend.__name__ == "Attend"


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 350, 80


def oversized(root: pathlib.Path = PACKAGE) -> list[str]:
    """Classes over ``MAX_CLASS_LINES`` and functions over ``MAX_FUNCTION_LINES`` (docstrings included)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES or \
                    isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(root.parent)}:{node.name} ({lines} lines)")
    return out


def test_no_class_over_350_lines_and_no_function_over_80():
    assert oversized() == []


def test_the_size_check_catches_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    root = _fake_package(tmp_path, {"__init__.py": "", "core/__init__.py": "",
                                    "core/long.py": f"def long():\n{body}\n\n\nclass Short:\n    pass\n"})
    assert oversized(root) == ["safeformer/core/long.py:long (81 lines)"]
