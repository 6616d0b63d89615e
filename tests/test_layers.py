"""The import graph of ``relax`` follows its layer order (docs/architecture.md, "Layers").

Every ``.py`` file under ``relax/`` is parsed with ``ast`` (nothing is imported), and every import
in it, at module level or inside a function, absolute or relative, ``import relax.x`` or
``from relax import x``, is mapped to the relax module it loads. The layers run from the core
modules up through the models, the algorithms, the planner and the service to the command line
(``relax.commands`` and ``relax.__main__``: ``relax <command>``, which may import every layer but
the top), with ``relax/__init__.py`` alone on top. Five rules are checked:

* every relax module belongs to a layer of ``LAYERS`` (a new top-level module or package is
  added to the table on purpose);
* an import points to the importer's own layer or a layer below it, never above;
* the modules do not import each other in a cycle;
* no module takes a private name (one leading underscore, not a dunder) from another: neither
  ``from relax.x import _name`` nor ``module._name`` on a name an import bound to a relax module;
* the algorithm folders (the packages ``relax.algorithms.<folder>``, one per algorithm) form a
  DAG of their own: a folder imports another only along an edge of ``ALGORITHM_EDGES``, a table
  that is itself acyclic and lists exactly the edges the code has; the common modules directly
  under ``relax/algorithms/`` (and its ``__init__``), which the folders share, import no folder
  except as ``COMMON_MODULE_EDGES`` declares. A piece two algorithms share moves down into a
  common module instead of one algorithm importing the other.

Importing a package means running its ``__init__``: ``from relax.models import Transformer`` is
an edge to ``relax.models``, and ``from relax.models.config.model import ModelConfig`` loads
``relax.models`` too (an implicit edge), except from inside ``relax.models`` itself, where
Python has already started the package. Imports under ``if TYPE_CHECKING:`` never run: they
count for the layer rule (a type from a higher layer is still an upward dependency) but not for
cycles (that is the usual way to name a type without a runtime cycle).

A last test imports ``relax`` in a fresh interpreter: the top level exposes the models, the
sampler, the tokenizers and ``compose``, and stays light (no training, tasks or algorithms).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "relax"

# Bottom first. A module may import from its own layer and the layers below it. Entries are
# either top-level modules (core) or packages (the package and everything under it).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("relax.compose", "relax.masked", "relax.choices", "relax.metrics", "relax.passes")),
    ("models", ("relax.models",)),
    ("text", ("relax.text",)),
    ("data", ("relax.data",)),
    ("rollout", ("relax.rollout",)),
    ("rewards", ("relax.rewards",)),
    ("environments", ("relax.environments",)),
    ("objectives", ("relax.objectives",)),
    ("eval", ("relax.eval",)),
    ("parallel", ("relax.parallel",)),
    ("train", ("relax.train",)),
    ("tasks", ("relax.tasks",)),
    ("algorithms", ("relax.algorithms",)),
    ("plan", ("relax.plan",)),  # compiles the algorithms' runs for TPU / GPU targets
    ("serve", ("relax.serve",)),  # every objective by name; the training service
    ("commands", ("relax.commands", "relax.__main__")),  # `relax <command>`: trainers, serve, plan
    ("top", ("relax",)),  # relax/__init__.py only: it may import anything
]
LAYER_NAMES = [name for name, _ in LAYERS]

# The sub-packages of relax.models, bottom first: a sub-package imports its own and those below it.
MODEL_PACKAGES = (
    "config",
    "layers",
    "attention",
    "moe",
    "decoder",
    "forward",
    "hf",
    "adapters",
    "heads",
    "vision",
)
# The shared sub-packages of relax.algorithms (what two or more algorithms run alike), bottom first;
# every other sub-package is one algorithm's folder.
SHARED_PACKAGES = ("cli", "online", "offline", "preference")

# Imports between algorithm folders (relax/algorithms/<folder>/): importer -> the folders it may
# import. Everything else two algorithms share lives in a shared sub-package of relax/algorithms
# (SHARED_PACKAGES: online/stages.py, preference/pairs.py, preference/reference_cache.py, ...).
ALGORITHM_EDGES: dict[str, tuple[str, ...]] = {
    "agent": (
        "grpo",
        "ppo",
    ),  # the multi-turn trainer runs GRPO's and PPO's steps, configs and states
    "rlhf": (
        "grpo",
        "ppo",
        "reward_model",
        "sft",
    ),  # the three-stage pipeline runs their runs in turn
}
# Shared modules (SHARED_PACKAGES and relax/algorithms/__init__) that import an algorithm folder, and
# which folders. None does today (cli/ and online/, the likeliest to, import no folder).
COMMON_MODULE_EDGES: dict[str, tuple[str, ...]] = {}

# What ``import relax`` may load: the top level exposes these layers' packages (models, rollout,
# text and compose from core) and nothing of training, tasks or algorithms.
TOP_LEVEL_LAYERS = {"core", "models", "text", "rollout"}
HEAVY_PACKAGES = ("relax.train", "relax.tasks", "relax.algorithms")
# Third-party libraries that only the data and training layers need.
HEAVY_THIRD_PARTY = ("orbax", "grain", "optax", "tensorboardX")


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module`` (None: in no layer)."""
    if module == "relax":
        return len(LAYERS) - 1
    for index, (_, entries) in enumerate(LAYERS[:-1]):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                return index
    return None


# --------------------------------------------------------------------------------------------
# The modules under relax/ and their imports.


def discover() -> tuple[dict[str, Path], set[str]]:
    """``({module: file}, packages)`` for every ``.py`` file under ``relax/``. Folders holding
    Python files without an ``__init__.py`` are namespace packages: modules with no source."""
    files: dict[str, Path] = {}
    packages: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        files[".".join(parts)] = path
        for i in range(1, len(parts)):  # every folder on the way is a package
            packages.add(".".join(parts[:i]))
    return files, packages


@dataclasses.dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`: never runs
    implicit: bool  # a parent package loaded on the way to the named module

    def where(self, files: dict[str, Path]) -> str:
        path = files.get(self.importer)
        return f"{path.relative_to(ROOT) if path else self.importer}:{self.line}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module):
    """``(node, type_only)`` for every import statement and every ``importlib.import_module`` /
    ``__import__`` call with a literal name, anywhere in the tree."""

    def visit(node: ast.AST, type_only: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("import_module", "__import__")
                )
            )
        ):
            yield node, type_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, True)
            for child in node.orelse:
                yield from visit(child, type_only)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, type_only)

    yield from visit(tree, False)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@dataclasses.dataclass
class Graph:
    files: dict[str, Path]
    packages: set[str]
    edges: list[Edge]
    unresolved: list[str]  # "file:line imports X" where X is no module under relax/


def build_graph() -> Graph:
    files, packages = discover()
    known = set(files) | packages
    edges: list[Edge] = []
    unresolved: list[str] = []

    for importer, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        own_ancestors = set(_ancestors(importer)) | ({importer} if is_package else set())

        def add(target: str, line: int, type_only: bool, where: str) -> None:
            if target != "relax" and not target.startswith("relax."):
                return
            if target not in known:
                unresolved.append(
                    f"{where}:{line} imports {target}, which is no module under relax/"
                )
                return
            edges.append(Edge(importer, target, line, type_only, implicit=False))
            for parent in _ancestors(target):  # packages Python runs on the way
                if parent != "relax" and parent not in own_ancestors:
                    edges.append(Edge(importer, parent, line, type_only, implicit=True))

        where = str(path.relative_to(ROOT))
        for node, type_only in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno, type_only, where)
            elif isinstance(node, ast.Call):
                add(node.args[0].value, node.lineno, type_only, where)
            else:  # ImportFrom
                base = node.module or ""
                if node.level:
                    base = _resolve_relative(importer, is_package, node.level, node.module)
                if base != "relax" and not base.startswith("relax."):
                    continue
                names_a_module = [
                    f"{base}.{alias.name}"
                    for alias in node.names
                    if f"{base}.{alias.name}" in known
                ]
                names_other = [
                    alias.name for alias in node.names if f"{base}.{alias.name}" not in known
                ]
                for sub in names_a_module:  # its package's __init__ comes with it (implicit edge)
                    add(sub, node.lineno, type_only, where)
                if names_other:
                    # Names defined by the package's __init__ (or the module's own names).
                    if base == "relax" and importer != "relax":
                        # `from relax import x` with x no module: x comes from the top level.
                        edges.append(
                            Edge(importer, "relax", node.lineno, type_only, implicit=False)
                        )
                    else:
                        add(base, node.lineno, type_only, where)
    return Graph(files, packages, edges, unresolved)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


# --------------------------------------------------------------------------------------------
# The rules.


def test_the_graph_sees_the_package(graph):
    """A guard on the parser itself: the known modules are found and known imports are seen."""
    assert {
        "relax",
        "relax.compose",
        "relax.models.decoder.transformer",
        "relax.rollout.sampler",
    } <= set(graph.files)
    pairs = {(e.importer, e.imported) for e in graph.edges}
    assert ("relax.rollout.sampler", "relax.models.decoder.transformer") in pairs
    assert ("relax", "relax.compose") in pairs


def test_every_module_belongs_to_a_layer(graph):
    modules = sorted(set(graph.files) | graph.packages)
    missing = [m for m in modules if layer_of(m) is None]
    assert not missing, (
        "these relax modules belong to no layer; add each to LAYERS in tests/test_layers.py on purpose "
        '(and to docs/architecture.md, "Layers"):\n  ' + "\n  ".join(missing)
    )


def test_every_relax_import_names_a_module(graph):
    """An import of a relax module that does not exist (left behind by a move) fails here
    rather than at import time in some later test."""
    unresolved = sorted(graph.unresolved)
    assert not unresolved, "imports of missing relax modules:\n  " + "\n  ".join(unresolved)


def test_imports_point_down_the_layers(graph):
    offending: dict[tuple[str, str], list[str]] = {}
    for edge in graph.edges:
        if edge.importer == "relax":  # the top-level package may import anything
            continue
        low, high = layer_of(edge.importer), layer_of(edge.imported)
        if low is None or high is None:
            continue  # reported by test_every_module_belongs_to_a_layer
        if high > low:
            note = (
                edge.where(graph.files)
                + (" (type only)" if edge.type_only else "")
                + (" (package __init__ loaded on the way)" if edge.implicit else "")
            )
            offending.setdefault((edge.importer, edge.imported), []).append(note)
    # A package loaded on the way to an offending submodule adds nothing to that pair's line.
    offending = {
        (a, b): where
        for (a, b), where in offending.items()
        if not (
            all("on the way" in w for w in where)
            and any(a2 == a and b2.startswith(b + ".") for a2, b2 in offending)
        )
    }
    lines = [
        f"{a} -> {b}   [{LAYER_NAMES[layer_of(a)]} imports {LAYER_NAMES[layer_of(b)]}]   "
        + ", ".join(sorted(set(where)))
        for (a, b), where in sorted(offending.items())
    ]
    assert not offending, (
        f"{len(offending)} import(s) point up the layer order "
        f"({' < '.join(LAYER_NAMES)}):\n  " + "\n  ".join(lines)
    )


def _cycles(nodes: set[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a cycle (Tarjan, iterative), each as one cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
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
                if len(component) > 1 or node in succ.get(node, ()):
                    components.append(sorted(component))

    def one_cycle(component: list[str]) -> list[str]:
        # Breadth-first from the component's first module back to itself, inside the component.
        members, start = set(component), component[0]
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier:
            following = []
            for node in frontier:
                for child in sorted(succ.get(node, ())):
                    if child not in members:
                        continue
                    if child == start:
                        path = [node]
                        while path[-1] != start:
                            path.append(previous[path[-1]])
                        return list(reversed(path)) + [start]
                    if child not in previous:
                        previous[child] = node
                        following.append(child)
            frontier = following
        return component

    return [(one_cycle(c), c) for c in components]


def test_no_import_cycles(graph):
    succ: dict[str, set[str]] = {}
    for edge in graph.edges:
        if not edge.type_only and edge.importer != edge.imported:
            succ.setdefault(edge.importer, set()).add(edge.imported)
    cycles = _cycles(set(graph.files) | graph.packages, succ)
    lines = [
        " -> ".join(cycle)
        + (
            f"   (one of a tangle of {len(members)}: {', '.join(members)})"
            if len(members) > len(cycle) - 1
            else ""
        )
        for cycle, members in cycles
    ]
    assert not cycles, "import cycles among relax modules:\n  " + "\n  ".join(lines)


def test_cycle_finder_finds_a_cycle():
    """The cycle finder on a small graph of its own (a cycle is not reported as none)."""
    succ = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(set(succ), succ) == [
        (["a", "b", "c", "a"], ["a", "b", "c"]),
        (["e", "e"], ["e"]),
    ]


# --------------------------------------------------------------------------------------------
# The algorithm folders form a DAG.


def algorithm_folder(module: str, packages: set[str]) -> str | None:
    """The algorithm folder ``module`` belongs to (``grpo`` for ``relax.algorithms.grpo.step``);
    None for a shared module (``SHARED_PACKAGES``), ``relax.algorithms`` itself or a module outside it."""
    parts = module.split(".")
    if (
        len(parts) >= 3
        and parts[:2] == ["relax", "algorithms"]
        and ".".join(parts[:3]) in packages
        and parts[2] not in SHARED_PACKAGES
    ):
        return parts[2]
    return None


def algorithm_imports(graph: Graph) -> dict[tuple[str, str], list[str]]:
    """``{(importer, folder): [file:line, ...]}``: every import of an algorithm folder from another
    folder or from a common module (the importer named by its folder, or by its module for a
    common module), type-only imports and packages loaded on the way included."""
    found: dict[tuple[str, str], list[str]] = {}
    for edge in graph.edges:
        target = algorithm_folder(edge.imported, graph.packages)
        if target is None or not edge.importer.startswith("relax.algorithms"):
            continue
        source = algorithm_folder(edge.importer, graph.packages)
        if source == target:
            continue
        importer = edge.importer if source is None else source  # None: a common module
        found.setdefault((importer, target), []).append(edge.where(graph.files))
    return found


def test_algorithm_folders_import_only_declared_folders(graph):
    folders = {m.split(".")[2] for m in graph.packages if algorithm_folder(m, graph.packages)}
    assert {"grpo", "ppo", "agent", "sft", "dpo", "kto", "distill", "reward_model"} <= folders
    declared = {(a, b) for a, bs in ALGORITHM_EDGES.items() for b in bs}
    common = {(a, b) for a, bs in COMMON_MODULE_EDGES.items() for b in bs}
    found = algorithm_imports(graph)
    undeclared = {k: v for k, v in found.items() if k not in declared | common}
    assert not undeclared, (
        "imports of an algorithm folder from another folder or a common module that ALGORITHM_EDGES / "
        "COMMON_MODULE_EDGES in tests/test_layers.py do not declare (move the shared piece down into a common "
        "package under relax/algorithms/, or declare the edge on purpose):\n  "
        + "\n  ".join(
            f"{a} -> {b}   " + ", ".join(sorted(set(w))) for (a, b), w in sorted(undeclared.items())
        )
    )
    unused = sorted((declared | common) - set(found))
    assert not unused, (
        f"declared edges the code no longer has (remove them from the tables): {unused}"
    )
    named = {a for a, _ in declared} | {b for _, b in declared | common}
    assert named <= folders, f"ALGORITHM_EDGES names no such folder: {sorted(named - folders)}"
    assert set(COMMON_MODULE_EDGES) <= set(graph.files), (
        f"COMMON_MODULE_EDGES names no such module: {sorted(set(COMMON_MODULE_EDGES) - set(graph.files))}"
    )


def test_declared_algorithm_edges_are_acyclic():
    succ = {a: set(bs) for a, bs in ALGORITHM_EDGES.items()}
    nodes = set(succ) | {b for bs in succ.values() for b in bs}
    cycles = _cycles(nodes, succ)
    assert not cycles, "ALGORITHM_EDGES has a cycle: " + "; ".join(
        " -> ".join(c) for c, _ in cycles
    )


def test_algorithm_import_finder_finds_them():
    """The finder on a made-up graph (an undeclared edge is not reported as none): a folder
    importing another, a common module importing a folder, a package loaded on the way."""
    packages = {"relax", "relax.algorithms", "relax.algorithms.a", "relax.algorithms.b"}
    files = {
        m: ROOT / "relax" / "x.py"
        for m in ("relax.algorithms.a.step", "relax.algorithms.b.loss", "relax.algorithms.common")
    }
    edges = [
        Edge("relax.algorithms.a.step", "relax.algorithms.b.loss", 3, False, False),
        Edge("relax.algorithms.a.step", "relax.algorithms.b", 3, False, True),
        Edge("relax.algorithms.common", "relax.algorithms.a", 5, False, False),
        Edge("relax.algorithms.b.loss", "relax.algorithms.common", 7, False, False),
        Edge("relax.algorithms.a.step", "relax.algorithms.a", 9, False, False),
    ]
    found = algorithm_imports(Graph(files, packages, edges, []))
    assert sorted(found) == [("a", "b"), ("relax.algorithms.common", "a")]
    assert len(found[("a", "b")]) == 2


# --------------------------------------------------------------------------------------------
# Private names stay in their module.


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_uses(
    importer: str, tree: ast.Module, is_package: bool, known: set[str]
) -> list[tuple[int, str]]:
    """``(line, what)`` for every private name ``importer`` takes from another relax module:
    ``from relax.x import _name`` (relative too), and ``module._name`` where ``module`` (or a dotted
    ``relax.x.y``) is a relax module bound by an import anywhere in the file."""
    uses: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # local name -> the relax module an import bound it to
    for node, _ in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "relax" or alias.name.startswith("relax."):
                    # `import relax.x.y as z` binds z to relax.x.y; `import relax.x.y` binds `relax`
                    bound[alias.asname or "relax"] = alias.name if alias.asname else "relax"
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(importer, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            if (base != "relax" and not base.startswith("relax.")) or base == importer:
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    uses.append((node.lineno, f"from {base} import {alias.name}"))
                if f"{base}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    attributes = sorted(
        (
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _is_private(node.attr)
        ),
        key=lambda node: (node.lineno, node.col_offset),
    )
    for node in attributes:
        head, _, rest = (_dotted(node.value) or "").partition(".")
        if head not in bound:
            continue
        module = bound[head] + (f".{rest}" if rest else "")
        if module in known and module != importer:
            uses.append((node.lineno, f"{_dotted(node.value)}.{node.attr}  ({module})"))
    return uses


def test_no_private_names_cross_modules():
    """A private name is its module's own business: another module needing it means it is public
    (renamed without the underscore, documented) or belongs in a shared module."""
    files, packages = discover()
    known = set(files) | packages
    found = []
    for importer, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, what in private_uses(importer, tree, path.name == "__init__.py", known):
            found.append(f"{path.relative_to(ROOT)}:{line}  {what}")
    assert not found, (
        f"{len(found)} private name(s) used across relax modules (make them public or "
        "keep them in their module):\n  " + "\n  ".join(sorted(found))
    )


def test_private_use_finder_finds_them():
    """The finder on a small module of its own (a crossing is not reported as none)."""
    source = """
import relax.models.hf.checkpoint
import relax.models.hf.checkpoint as hf_mod
from relax.rollout import turns
from relax.models.hf.checkpoint import _read, load_pretrained, __all__
from . import sampler as s
from .sampler import _helper


def f(x):
    from relax.models.adapters import peft
    return (turns._start, hf_mod._write, relax.models.hf.checkpoint._build, s._prefill, peft._name,
            turns.start._cache, x._private, load_pretrained._cached, relax.models.__name__)
"""
    known = {
        "relax",
        "relax.models",
        "relax.models.hf.checkpoint",
        "relax.models.adapters.peft",
        "relax.rollout",
        "relax.rollout.turns",
        "relax.rollout.sampler",
        "relax.rollout.naive",
    }
    uses = private_uses("relax.rollout.naive", ast.parse(source), False, known)
    assert [what.split("  ")[0] for _, what in uses] == [
        "from relax.models.hf.checkpoint import _read",
        "from relax.rollout.sampler import _helper",
        "turns._start",
        "hf_mod._write",
        "relax.models.hf.checkpoint._build",
        "s._prefill",
        "peft._name",
    ]


# --------------------------------------------------------------------------------------------
# The top-level import.

PROBE = """
import json, sys
import relax
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m == "relax" or m.startswith("relax.")),
    "third_party": sorted(m for m in %r if m in sys.modules),
    "exposed": {name: hasattr(relax, name) for name in
                ("compose", "stage", "Stage", "Transformer", "ModelConfig", "generate", "Rollout",
                 "load_tokenizer", "load_pretrained", "save_pretrained")},
}))
""" % (HEAVY_THIRD_PARTY,)  # noqa: UP031 (the probe is Python source with braces)


def test_import_relax_is_light():
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"`python -c 'import relax'` failed:\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    modules = report["modules"]

    heavy = [m for m in modules if any(m == p or m.startswith(p + ".") for p in HEAVY_PACKAGES)]
    assert not heavy, (
        f"`import relax` loads {heavy}: keep the top level free of training, tasks and algorithms"
    )

    beyond = [
        m
        for m in modules
        if m != "relax"
        and (layer_of(m) is None or LAYER_NAMES[layer_of(m)] not in TOP_LEVEL_LAYERS)
    ]
    assert not beyond, (
        f"`import relax` loads {beyond}, outside the layers the top level exposes "
        f"({sorted(TOP_LEVEL_LAYERS)})"
    )

    assert not report["third_party"], (
        f"`import relax` loads {report['third_party']} (data/training libraries)"
    )

    for exposed in ("relax.compose", "relax.models", "relax.rollout", "relax.text"):
        assert exposed in modules, f"`import relax` should expose {exposed}"
    missing = [name for name, present in report["exposed"].items() if not present]
    assert not missing, f"relax no longer exposes {missing} at the top level"


# --------------------------------------------------------------------------------------------
# Sub-packages: every module of relax.models and relax.algorithms lives in one, in their order.


def sub_package(module: str, parent: str) -> str | None:
    """``hf`` for ``relax.models.hf.config`` under ``relax.models``; None outside ``parent``."""
    parts, base = module.split("."), parent.split(".")
    return parts[len(base)] if parts[: len(base)] == base and len(parts) > len(base) else None


@pytest.mark.parametrize("parent", ["relax.models", "relax.algorithms"])
def test_no_loose_modules(graph, parent):
    """Only the package's face (``__init__.py``) stands directly under it; every other module is in a
    sub-package, so the folder list shows the architecture."""
    loose = sorted(
        m
        for m in graph.files
        if m not in graph.packages
        and sub_package(m, parent) is not None
        and f"{parent}.{sub_package(m, parent)}" == m
    )
    assert not loose, f"modules directly under {parent} (move each into a sub-package): {loose}"


@pytest.mark.parametrize(
    "parent, order", [("relax.models", MODEL_PACKAGES), ("relax.algorithms", SHARED_PACKAGES)]
)
def test_sub_packages_import_down_their_order(graph, parent, order):
    """Inside ``relax.models`` (and among the shared packages of ``relax.algorithms``) a sub-package
    imports only its own and those listed before it; every model sub-package is listed."""
    if parent == "relax.models":
        present = {sub_package(m, parent) for m in set(graph.files) | graph.packages} - {None}
        assert present == set(order), (
            f"MODEL_PACKAGES differs from relax/models/: {sorted(present ^ set(order))}"
        )
    offending = set()
    for edge in graph.edges:
        a, b = sub_package(edge.importer, parent), sub_package(edge.imported, parent)
        if a in order and b in order and order.index(b) > order.index(a) and not edge.type_only:
            offending.add(f"{a} -> {b}   {edge.where(graph.files)}")
    assert not offending, f"imports up the order {' < '.join(order)}:\n  " + "\n  ".join(
        sorted(offending)
    )


# The files of an algorithm folder: its config, loss, step and run. A folder that trains other
# folders' algorithms borrows what it lacks: agent trains GRPO's and PPO's losses on trajectories;
# rlhf is a pipeline that runs other folders' runs in turn.
ALGORITHM_FILES = ("config", "loss", "step", "run")
BORROWED = {"agent": ("loss",), "rlhf": ("config", "loss", "step")}


def test_algorithm_folders_have_the_same_files():
    root = PACKAGE / "algorithms"
    folders = sorted(
        p.name
        for p in root.iterdir()
        if (p / "__init__.py").exists() and p.name not in SHARED_PACKAGES
    )
    assert set(BORROWED) <= set(folders), sorted(set(BORROWED) - set(folders))
    for folder in folders:
        for name in ALGORITHM_FILES:
            present = (root / folder / f"{name}.py").exists()
            borrowed = name in BORROWED.get(folder, ())
            assert present != borrowed, f"relax/algorithms/{folder}/{name}.py " + (
                "is missing" if not present else "exists: drop it from BORROWED"
            )
