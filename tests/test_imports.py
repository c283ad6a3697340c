"""The package's import graph: imports point one way, down the layer order of DESIGN.md, with no
cycles.

The layers, bottom to top: the ground (errors, config, artifacts, run_dir, disk, user_code) <
tokenizer < data < model < train < infer < eval < posttrain < serve < release < pipeline < cli
(with ``__main__``, the ``scripts`` entry points and the package's front door). A module may
import its own layer and those below it; an import of a layer above is an upward edge and fails.
import-linter's "layers" contract states the same rule; this test reads the graph itself so that
it needs no extra package, names each edge's line, and shares the walker with the cycle checks.

The graph is read from the source with ``ast`` (nothing is imported), so the test is fast and
sees every module, including ones whose optional dependencies are missing. Three kinds of edge
are told apart, and every check counts all three:

- module-level imports (a module's top level and class bodies, ``try``/``if`` blocks included)
  execute when the module is imported, so a cycle among them is a real import cycle;
- imports inside functions run later. They are a common way to hide a cycle: a package whose
  lazy imports close a loop still has two modules that each need the other;
- type-only imports (``if TYPE_CHECKING:``) never run, but they are a dependency all the same:
  the module cannot be read, checked or moved without the one it names.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "olmoflow"
# Only these may import the glue package (DESIGN.md, "Layout": libraries never import pipeline/).
PIPELINE = "olmoflow.pipeline"
MAY_IMPORT_PIPELINE = ("olmoflow.pipeline", "olmoflow.cli")

#: The library's layers, bottom to top, by the first name under ``olmoflow`` ("" is the package's
#: own ``__init__``, its front door). Every module belongs to one: a new package gets its place
#: here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "config", "artifacts", "run_dir", "disk", "user_code", "recorded"),
    ("tokenizer",),
    ("data",),
    ("model",),
    ("train",),
    ("infer",),
    ("eval",),
    ("posttrain",),
    ("serve",),
    ("release",),
    ("pipeline",),
    ("cli", "__main__", "scripts", ""),
)

#: Upward edges known and not yet removed, each ``(importer, imported): why``. An entry whose
#: edge is gone fails the test too, so the list only shrinks.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    # The model class's transformers-style conveniences delegate to infer/ lazily:
    # Olmo.generate and Olmo.from_pretrained(load_in_8bit=True / quantization=...). generate,
    # speculative, sampling and quantize use nothing above model/: removing these means moving
    # them below the model class (as transformers' GenerationMixin is), or dropping the two
    # conveniences. Olmo.generate enters through speculative, which calls generate.
    ("olmoflow.model.olmo", "olmoflow.infer.speculative"): "Olmo.generate",
    ("olmoflow.model.olmo", "olmoflow.infer.quantize"): "Olmo.from_pretrained quantization",
}


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` at ``line``; ``lazy`` when inside a function body,
    ``type_only`` when under ``if TYPE_CHECKING:``."""

    importer: str
    imported: str
    line: int
    lazy: bool
    type_only: bool = False


def module_names(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``src``: dotted name -> file (``pkg/__init__.py`` is
    ``pkg``)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    node: ast.AST, lazy: bool = False, type_only: bool = False,
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement under ``node`` with whether it runs lazily (inside a function) and
    whether it is type-only (under ``if TYPE_CHECKING:``, never run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy, type_only
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            # The body is for type checkers only; the `else:` branch runs as this node's own.
            yield from _imports(ast.Module(body=child.body, type_ignores=[]), lazy, True)
            yield from _imports(ast.Module(body=child.orelse, type_ignores=[]), lazy, type_only)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _imports(child, True, type_only)
        else:
            yield from _imports(child, lazy, type_only)


def import_edges(modules: dict[str, Path], package: str = PACKAGE) -> list[Edge]:
    """The imports between modules of ``package``.

    ``from a.b import c`` points at module ``a.b.c`` when there is one, else at ``a.b`` (``c`` is
    a name defined there). Relative imports are resolved against the importing module.
    """
    edges = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, lazy, type_only in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                # `import a.b.c` of a name that is no module: the longest prefix that is one.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                inside = target == package or target.startswith(package + ".")
                if target and target != name and inside:
                    edges.append(Edge(name, target, node.lineno, lazy, type_only))
    return edges


def _graph(edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    return graph


def import_groups(edges: list[Edge]) -> list[set[str]]:
    """The strongly connected groups of two or more modules (each reaches every other), by
    Tarjan's algorithm; a graph whose imports point one way has none."""
    graph = _graph(edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return groups


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """One shortest cycle ``[a, b, ..., a]`` through each group of :func:`import_groups`, starting
    at the group's first module by name; sorted."""
    graph = _graph(edges)
    cycles = []
    for group in import_groups(edges):
        start = min(group)
        parent: dict[str, str] = {}
        frontier, last = [start], None
        while last is None:  # breadth-first inside the group: it is strongly connected
            nxt = []
            for v in frontier:
                succ = graph[v] & group
                if start in succ:
                    last = v
                    break
                for w in sorted(succ - parent.keys()):
                    parent[w] = v
                    nxt.append(w)
            frontier = nxt
        path = [last]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append([*reversed(path), start])
    return sorted(cycles)


def _kind(e: Edge) -> str:
    return " (type-only)" if e.type_only else " (in a function)" if e.lazy else ""


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (``olmoflow.data.sources`` -> that of ``data``);
    None for a top-level name no layer lists (:func:`test_every_module_has_a_layer` names it)."""
    top = module.split(".")[1] if "." in module else ""
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def upward_edges(edges: list[Edge]) -> list[Edge]:
    """The edges from a layer to one above it, one per (importer, imported) pair (its first
    line), sorted."""
    first: dict[tuple[str, str], Edge] = {}
    for e in sorted(edges, key=lambda e: e.line):
        low, high = layer_of(e.importer), layer_of(e.imported)
        if low is not None and high is not None and high > low:
            first.setdefault((e.importer, e.imported), e)
    return [first[k] for k in sorted(first)]


def _describe(edges: list[Edge]) -> str:
    """One line per cycle: the loop, where each hop is imported, and the rest of its group."""
    # A module-level import explains a hop better than a lazy or a type-only one; the earliest
    # line first.
    where = {}
    for e in sorted(edges, key=lambda e: (e.type_only, e.lazy, e.line), reverse=True):
        where[e.importer, e.imported] = e
    groups = import_groups(edges)
    lines = []
    for cycle in find_cycles(edges):
        hops = ", ".join(f"{a}:{where[a, b].line}{_kind(where[a, b])}"
                         for a, b in itertools.pairwise(cycle))
        group = next(g for g in groups if cycle[0] in g)
        rest = sorted(group - set(cycle))
        also = f"; the same knot also holds {', '.join(rest)}" if rest else ""
        lines.append(f"{' -> '.join(cycle)}   [{hops}]{also}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(module_names())


def test_the_graph_sees_the_package(edges):
    # Guards the walker itself: a parser that found no imports would pass every check below.
    modules = module_names()
    assert "olmoflow.model.olmo" in modules and "olmoflow.pipeline" in modules
    assert any(
        e.importer == "olmoflow.model.olmo" and e.imported == "olmoflow.model.config" and not e.lazy
        for e in edges
    )
    assert any(e.lazy for e in edges)


def test_find_cycles_names_each_loop():
    e = [Edge("p.a", "p.b", 1, False), Edge("p.b", "p.c", 1, False), Edge("p.c", "p.a", 1, True),
         Edge("p.c", "p.d", 1, False), Edge("p.d", "p.e", 1, False), Edge("p.e", "p.d", 1, False)]
    assert find_cycles(e) == [["p.a", "p.b", "p.c", "p.a"], ["p.d", "p.e", "p.d"]]
    assert find_cycles([x for x in e if not x.lazy]) == [["p.d", "p.e", "p.d"]]


def test_edges_resolve_relative_and_mark_type_checking(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import x\n")
    (pkg / "sub" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nfrom ..y import thing\nif TYPE_CHECKING:\n"
        "    from p.z import T\n\ndef f():\n    import p.z\n"
    )
    (pkg / "y.py").write_text("import p.sub.x\n")
    (pkg / "z.py").write_text("")
    got = {(e.importer, e.imported, e.lazy, e.type_only)
           for e in import_edges(module_names(tmp_path, "p"), "p")}
    assert got == {("p.sub", "p.sub.x", False, False), ("p.sub.x", "p.y", False, False),
                   ("p.sub.x", "p.z", False, True), ("p.sub.x", "p.z", True, False),
                   ("p.y", "p.sub.x", False, False)}


def test_no_import_cycles(edges):
    eager = [e for e in edges if not e.lazy and not e.type_only]
    assert not find_cycles(eager), "module-level import cycles:\n" + _describe(eager)


def test_no_import_cycles_through_function_level_or_type_only_imports(edges):
    assert not find_cycles(edges), (
        "import cycles closed by imports inside functions or under TYPE_CHECKING (the imports "
        "no longer point one way):\n" + _describe(edges)
    )


def test_every_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in module_names() if "." in m
                       if not any(m.split(".")[1] in names for names in LAYERS)})
    assert not unplaced, f"packages or modules in no layer of LAYERS: {unplaced}"


def test_upward_edges_are_named_and_the_order_is_enforced():
    # Guards the rule itself: a walker or a layer table that let everything through passes.
    e = [Edge("olmoflow.data.x", "olmoflow.model.y", 3, True),
         Edge("olmoflow.data.x", "olmoflow.model.y", 9, False),
         Edge("olmoflow.model.y", "olmoflow.data.x", 1, False),
         Edge("olmoflow.tokenizer.t", "olmoflow.errors", 1, False),
         Edge("olmoflow.errors", "olmoflow.cli", 5, False, type_only=True)]
    assert [(u.importer, u.imported, u.line) for u in upward_edges(e)] == [
        ("olmoflow.data.x", "olmoflow.model.y", 3), ("olmoflow.errors", "olmoflow.cli", 5)]
    assert layer_of("olmoflow") == layer_of("olmoflow.cli") == len(LAYERS) - 1
    assert layer_of("olmoflow.nowhere") is None
    assert layer_of("olmoflow.run_dir") == 0 < layer_of("olmoflow.tokenizer.bpe")


def test_imports_point_down_the_layer_order(edges):
    order = " < ".join("/".join(n or "olmoflow" for n in names) for names in LAYERS)
    bad = [f"{e.importer}:{e.line} imports {e.imported}{_kind(e)}"
           for e in upward_edges(edges) if (e.importer, e.imported) not in ALLOWED_UPWARD]
    assert not bad, f"imports up the layer order ({order}):\n" + "\n".join(bad)


def test_the_allowed_upward_edges_still_exist(edges):
    present = {(e.importer, e.imported) for e in upward_edges(edges)}
    gone = sorted(f"{a} -> {b}" for a, b in ALLOWED_UPWARD if (a, b) not in present)
    assert not gone, ("these upward edges are gone: remove them from ALLOWED_UPWARD in "
                      "tests/test_imports.py:\n" + "\n".join(gone))


def test_the_data_package_never_imports_torch():
    # DESIGN.md: data/ turns raw text into token arrays without torch, so its worker processes
    # never pay torch's import; what makes training instances of the arrays lives in train/.
    bad = []
    for name, path in module_names().items():
        if name == "olmoflow.data" or name.startswith("olmoflow.data."):
            for node, _, _ in _imports(ast.parse(path.read_text(), filename=str(path))):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if not node.level else [])
                bad += [f"{name}:{node.lineno} imports {m}" for m in mods
                        if m == "torch" or m.startswith("torch.")]
    assert not bad, "data/ imports torch:\n" + "\n".join(bad)
