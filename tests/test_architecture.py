"""The shape of the package: imports only point down (no cycle, lazy imports included), and no
source file is too long to read whole.

The import graph is read from the source with ``ast``, not by importing it: every ``import`` and
``from ... import`` anywhere in a module (at the top, inside functions, under ``TYPE_CHECKING``),
relative or absolute, adds an arrow to the ``kvcake`` module it names (``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``). Importing ``a.b`` also runs
``a/__init__.py``; that implicit arrow is not counted, so a package's ``__init__`` may re-export
its submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "kvcake"
MAX_LINES = 400
README = SRC.parent / "README.md"

# The map of the README's "Architecture" section, top to bottom: a module may import its own row
# or the rows below it, never a row above. A module belongs to the row of its longest listed
# prefix (``calibration.cli`` is a face; the rest of ``calibration`` sits beside the API).
LAYERS = {
    "faces": ["cli", "eval", "bench", "demo", "inspect", "calibration.cli", "standalone"],
    "package": ["kvcake"],
    "api": ["answers", "api", "calibration", "replay", "storage", "storage.reader"],
    "context": ["context"],
    "cache": [
        "cache",
        "cascade",
        "cake_tau",
        "head_counts",
        "pending_norms",
        "decoding",
        "attention",
        "storage.writer",
    ],
    "method": ["method", "temperatures", "layer", "step", "sliding", "cross", "latent", "hybrid_layer"],
    "parts": [
        "allocators",
        "scorers",
        "selectors",
        "budget",
        "dense",
        "ragged",
        "sequences",
        "sliding_appends",
        "position_weights",
        "fp8",
        "storage.format",
        "tensor_parallel",
        "head_shards",
    ],
    "base": [
        "models",
        "fingerprints",
        "conversion",
        "gguf_tokenizer",
        "gguf_parts",
        "adapters",
        "model_code",
        "layer_types",
        "recurrent",
        "devices",
        "row_products",
        "sdpa",
        "varlen",
        "matmul",
        "flex",
        "logit_terms",
        "fused_norms",
        "prompts",
        "haystack",
        "version",
        "defaults",
        "scenarios",
        "lazy",
    ],
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under src/kvcake (a package is its __init__)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a kvcake module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the kvcake modules it imports anywhere in its source."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        here = module.split(".") if is_package else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                names = [
                    f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem
                    for alias in node.names
                ]
            else:
                continue
            for name in names:
                target = _resolve(name, modules) if name.split(".")[0] == PACKAGE else None
                if target is not None and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete cycle through the component's smallest module (breadth-first, shortest)."""
    start = min(component)
    parents = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                path = [v]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if w not in parents:
                parents[w] = v
                queue.append(w)
    raise AssertionError("a strongly connected component without a cycle")  # pragma: no cover


def test_no_import_cycle():
    cycles = find_cycles(import_graph(_modules()))
    assert not cycles, "import cycles (move the shared concept down):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_no_source_file_over_the_limit():
    lines = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in _modules().values()}
    long = {p.relative_to(SRC).as_posix(): n for p, n in lines.items() if n > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by responsibility): {long}"


def _row(module: str) -> int:
    """The index in LAYERS of the module's row (longest listed prefix), or -1 if it is unlisted."""
    name = module.removeprefix(PACKAGE).removeprefix(".") or PACKAGE
    best, row = "", -1
    for i, names in enumerate(LAYERS.values()):
        for n in names:
            if (name == n or name.startswith(n + ".")) and len(n) > len(best):
                best, row = n, i
    return row


def test_every_module_is_on_the_map():
    unlisted = sorted(m for m in _modules() if _row(m) < 0)
    assert not unlisted, f"modules on no row of LAYERS (and of the README's map): {unlisted}"


def test_imports_point_down_the_map():
    rows = list(LAYERS)
    up = sorted(
        f"{a} ({rows[_row(a)]}) -> {b} ({rows[_row(b)]})"
        for a, targets in import_graph(_modules()).items()
        for b in targets
        if _row(b) < _row(a)
    )
    assert not up, "imports that point up the map (move the shared concept down):\n" + "\n".join(up)


def test_the_readme_map_names_every_row_entry():
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Architecture") :]
    section = section[: section.index("\n## ", 1)]
    missing = [
        n
        for names in LAYERS.values()
        for n in names
        if n != PACKAGE and not any(f"{n.replace('.', '/')}{end}" in section for end in (".py", "/", " "))
    ]
    assert not missing, f"not on the README's architecture map: {missing}"


# The checker itself must be able to fail: a cycle it is shown is found and named.


def test_the_checker_finds_cycles_and_names_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .low import x\n")
    (pkg / "low.py").write_text("def f():\n    from .sub import mod  # lazy, relative\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("from ..low import f\nimport kvcake.sub\n")
    modules = {
        "kvcake": pkg / "__init__.py",
        "kvcake.low": pkg / "low.py",
        "kvcake.sub": pkg / "sub" / "__init__.py",
        "kvcake.sub.mod": pkg / "sub" / "mod.py",
    }
    graph = import_graph(modules)
    assert graph == {
        "kvcake": {"kvcake.low"},
        "kvcake.low": {"kvcake.sub.mod"},
        "kvcake.sub": set(),
        "kvcake.sub.mod": {"kvcake.low", "kvcake.sub"},
    }
    assert find_cycles(graph) == [["kvcake.low", "kvcake.sub.mod", "kvcake.low"]]


@pytest.mark.parametrize("module", ["kvcake.api", "kvcake.method", "kvcake.cache", "kvcake.storage"])
def test_the_core_modules_are_in_the_graph(module):
    assert module in import_graph(_modules())
