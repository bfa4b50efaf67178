"""The core's import layers (issue 38): the import graph of core/rlcore, read from the source (nothing is imported),
has no cycle and none of the arrows FORBIDDEN lists. Every ``import`` and ``from`` counts wherever it sits: inside a
function or a class, under ``if TYPE_CHECKING:`` (a type-only import still ties the two modules' designs together).

KNOWN lists today's violations, each with the line that causes it and what removes it. The test fails when a new
one appears, and when a KNOWN one is gone (then delete its entry): the list only shrinks."""
import ast
from functools import cache
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"

# Packages that left the core for distributions of their own (rlcore-verl, rlcore-agent-tools, rlcore-testing); the
# core must not import them, nor the distributions.
LEAVING = ("rlcore.verl", "rlcore.multiturn", "rlcore.testing")
DISTRIBUTIONS = ("rlcore_model_", "rlcore_algo_", "rlcore_rollout_", "rlcore_verl", "rlcore_agent_tools",
                 "rlcore_testing")

# (importers, imported, why). A name covers the module or package and everything under it.
FORBIDDEN = [
    (("rlcore.loop",), ("rlcore.run", "rlcore.workers", "rlcore.multiturn"),
     "the loop drives the parts it is given; building them and the workers are run's"),
    (("rlcore.rollout", "rlcore.learner", "rlcore.checkpoint", "rlcore.checkpoints"), ("rlcore.workers",),
     "consumers get typed proxies through their constructors; only run and workers/ import rlcore.workers"),
    (("rlcore.megatron",), ("rlcore.weight_sync",), "the training backend knows nothing of where its weights go"),
    (("rlcore.config",), ("rlcore.megatron", "rlcore.hf_to_megatron"),
     "reading a config must not load the training backend or the convert command"),
]

# (importer, imported): where, and what removes it. The importing modules' lines, as of the entry's writing.
KNOWN: dict[tuple[str, str], str] = {}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) of every module of core/rlcore."""
    found = {}
    for path in sorted((CORE / "rlcore").rglob("*.py")):
        parts = path.relative_to(CORE).with_suffix("").parts
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


@cache
def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> the ``file:line``s of the imports that make it. A core target is the deepest core
    module the imported name lies in (``from rlcore.x import name`` is an arrow to rlcore.x, ``from rlcore import
    x`` one to rlcore.x); a distribution's, its top-level package; other packages are left out."""
    mods = modules()

    def owner(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rpartition(".")[0]
        return name

    edges: dict[tuple[str, str], list[str]] = {}
    for module, (path, package) in mods.items():
        for name, line in imported_names(path.read_text(), module if package else module.rpartition(".")[0]):
            top = name.split(".")[0]
            target = owner(name) if top == "rlcore" else top
            if target != module and top.startswith("rlcore"):
                edges.setdefault((module, target), []).append(f"{path.relative_to(CORE.parent)}:{line}")
    return edges


def imported_names(source: str, package: str) -> list[tuple[str, int]]:
    """(dotted name, line) of everything a module's source imports, anywhere in it; ``package``: the module's own,
    against which relative imports resolve."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:     # one package up per dot after the first
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return sorted(found, key=lambda found: found[1])


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def forbidden(importer: str, imported: str) -> str | None:
    """Why the arrow may not exist, or None."""
    if importer.split(".")[0] == "rlcore" and not within(importer, LEAVING):
        if imported.startswith(DISTRIBUTIONS):
            return "the core does not import a distribution built on it"
        if within(imported, LEAVING):
            return f"{imported} leaves the core for a distribution of its own"
    for importers, targets, why in FORBIDDEN:
        if within(importer, importers) and within(imported, targets):
            return why
    return None


def strongly_connected(edges) -> list[list[str]]:
    """The graph's components of more than one module, each a set of modules that import one another in a cycle
    (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def a_cycle(component: list[str], edges) -> list[str]:
    """The shortest cycle through the component's first module, in import order, first module repeated at the end."""
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for a in frontier:
            for b in sorted(b for (x, b) in edges if x == a and b in component):
                if b == start:
                    return paths[a] + [start]
                if b not in paths:
                    paths[b] = paths[a] + [b]
                    following.append(b)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def described(cycle: list[str], edges) -> str:
    return "\n".join(f"  {a} -> {b}  ({', '.join(sorted(set(edges[(a, b)])))})" for a, b in zip(cycle, cycle[1:]))


def test_the_graph_is_read():
    edges = import_graph()
    assert ("rlcore.loop", "rlcore.cadence") in edges                  # module level
    assert ("rlcore.lora.layers", "rlcore.megatron.names") in edges   # inside a function
    assert ("rlcore.evaluation", "rlcore.rollout.source") in edges      # under TYPE_CHECKING
    assert ("rlcore.run", "rlcore.checkpoint") in edges                 # from rlcore import checkpoint


def test_every_import_counts_and_relative_ones_resolve():
    source = ("from typing import TYPE_CHECKING\n"
              "import rlcore.a.b\n"
              "from . import sibling\n"
              "from ..up import thing\n"
              "if TYPE_CHECKING:\n    from .typed import T\n"
              "def f():\n    from rlcore import late\n"
              "class C:\n    import rlcore.in_class\n")
    assert imported_names(source, "rlcore.pkg.sub") == [
        ("typing.TYPE_CHECKING", 1), ("rlcore.a.b", 2), ("rlcore.pkg.sub.sibling", 3), ("rlcore.pkg.up.thing", 4),
        ("rlcore.pkg.sub.typed.T", 6), ("rlcore.late", 8), ("rlcore.in_class", 10)]


def test_a_cycle_is_reported_in_import_order():
    edges = {("m.a", "m.b"): [], ("m.b", "m.c"): [], ("m.c", "m.a"): [], ("m.c", "m.d"): [], ("m.d", "m.e"): []}
    assert strongly_connected(edges) == [["m.a", "m.b", "m.c"]]
    assert a_cycle(["m.a", "m.b", "m.c"], edges) == ["m.a", "m.b", "m.c", "m.a"]


def test_no_new_forbidden_arrow():
    edges = import_graph()
    new = {arrow: why for arrow in edges if (why := forbidden(*arrow)) and arrow not in KNOWN}
    assert not new, "forbidden imports:\n" + "\n".join(
        f"  {a} -> {b}  ({', '.join(sorted(set(edges[(a, b)])))}): {why}" for (a, b), why in sorted(new.items()))


def test_no_cycle():
    edges = import_graph()
    tolerated = {arrow: where for arrow, where in edges.items() if arrow not in KNOWN}
    cycles = [a_cycle(c, tolerated) for c in strongly_connected(tolerated)]
    assert not cycles, "import cycles:\n" + "\n\n".join(described(c, tolerated) for c in cycles)


def test_known_violations_still_exist():
    """A KNOWN arrow that is gone, or that is no longer forbidden nor on a cycle, leaves the list."""
    edges = import_graph()
    on_cycles = {(a, b) for c in strongly_connected(edges) for (a, b) in edges if a in c and b in c}
    stale = [arrow for arrow in KNOWN if arrow not in edges or not (forbidden(*arrow) or arrow in on_cycles)]
    assert not stale, "KNOWN entries no longer violated (delete them): " + ", ".join(f"{a} -> {b}" for a, b in stale)
