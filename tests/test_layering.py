"""The import layering of ``fp_dcp/`` (docs/ARCHITECTURE.md, "Layers").

Every import counts, also those inside functions.  A module may import
modules of its own layer group or of a lower layer; never a higher layer,
never a sibling group of the same layer (``save`` and ``load``); and no
import cycle.  The known exceptions are listed in ``ALLOWED``, each with its
reason: the list only shrinks.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "fp_dcp"


def _layers() -> list[list[list[str]]]:
    """docs/ARCHITECTURE.md's ``layers`` block, lowest layer first: each
    layer a list of groups, each group a list of module prefixes."""
    doc = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
    block = doc.split("```layers\n", 1)[1].split("```", 1)[0]
    layers = []
    for line in block.strip().splitlines():
        _, groups = line.split(":", 1)
        layers.append([[name.strip("`") for name in group.split()] for group in groups.split("|")])
    return layers[::-1]


LAYERS = _layers()

# (importer, imported): known violations, to be removed.
ALLOWED: dict[tuple[str, str], str] = {
    # _dcp_hooks is both the torch shim (lowest layer) and the default-storage
    # switch, which builds writers and readers: splitting the switch out into
    # a top-layer module empties these three.
    ("fp_dcp._dcp_hooks", "fp_dcp.save.writer"): "the default-storage switch lives in the torch shim",
    ("fp_dcp._dcp_hooks", "fp_dcp.load.reader"): "the default-storage switch lives in the torch shim",
    ("fp_dcp._dcp_hooks", "fp_dcp.load.stock"): "the default-storage switch lives in the torch shim",
    ("fp_dcp._dcp_hooks", "fp_dcp.planners"): "the default-storage switch lives in the torch shim",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").is_file() or (ROOT.parent / rel / "__init__.py").is_file()


def _exports() -> dict[str, str]:
    """``fp_dcp``'s lazy exports: ``from fp_dcp import FastPersistWriter`` imports its module."""
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("fp_dcp/__init__.py has no _EXPORTS")


def _imported(module: str, is_package: bool, node: ast.AST, exports: dict[str, str]) -> set[str]:
    """The fp_dcp modules an import statement loads (not the parents it loads implicitly)."""
    if isinstance(node, ast.Import):  # bare ``import fp_dcp``: the lazy root, loaded by every submodule anyway
        return {a.name for a in node.names if a.name.startswith("fp_dcp.")}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "fp_dcp":
        return set()
    out = set()
    for alias in node.names:
        name = f"{source}.{alias.name}"
        if _is_module(name):
            out.add(name)
        elif source == "fp_dcp" and alias.name in exports:
            out.add(exports[alias.name])
        elif source != "fp_dcp":  # a name from a module (or from a package's __init__)
            out.add(source)
    return out


def import_graph() -> dict[str, set[str]]:
    exports = _exports()
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        edges = graph.setdefault(module, set())
        for node in ast.walk(tree):  # every import, at any depth
            edges |= _imported(module, path.name == "__init__.py", node, exports)
        edges.discard(module)
    return graph


def layer_of(module: str) -> tuple[int, int]:
    """(layer, group) of ``module``: its longest matching prefix."""
    best: tuple[int, tuple[int, int]] | None = None
    for li, layer in enumerate(LAYERS):
        for gi, group in enumerate(layer):
            for prefix in group:
                covers = module == prefix or module.startswith(prefix + ".")
                if covers and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), (li, gi))
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md"
    return best[1]


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        mine = layer_of(module)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            upward = theirs[0] > mine[0]
            sideways = theirs[0] == mine[0] and theirs[1] != mine[1]
            if (upward or sideways) and (module, dep) not in ALLOWED:
                out.append(f"{module} imports {dep} ({'a higher layer' if upward else 'a sibling group'})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, not counting the allowed edges (one cycle per start)."""
    found = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if (m, d) in ALLOWED:
                continue
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_lower_layer_imports_a_higher_one():
    assert violations(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_allowed_exception_is_still_needed():
    graph = import_graph()
    stale = [pair for pair in ALLOWED if pair[1] not in graph.get(pair[0], set())]
    assert stale == [], f"remove these from ALLOWED: {stale}"


def test_every_module_is_in_a_layer():
    assert len(LAYERS) >= 5 and all(layer_of(m) for m in import_graph())


@pytest.mark.parametrize("source, module, bad", [
    ("def f():\n    from fp_dcp.save import writer\n", "fp_dcp.engine", "fp_dcp.save.writer"),
    ("from fp_dcp.load.jobs import Job\n", "fp_dcp.save.plan", "fp_dcp.load.jobs"),
    ("from ..tools.rotation import keep_last\n", "fp_dcp.tiers.store", "fp_dcp.tools.rotation"),
    ("from fp_dcp import FastPersistReader\n", "fp_dcp.staging.arena", "fp_dcp.load.reader"),
])
def test_the_check_sees_imports_inside_functions_relative_and_lazy(source, module, bad):
    """The check is not vacuous: an upward import in a function body, a
    sibling import, a relative import and a lazy export are each caught."""
    exports = _exports()
    edges: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        edges |= _imported(module, False, node, exports)
    assert edges == {bad}
    kind = "a sibling group" if module == "fp_dcp.save.plan" else "a higher layer"
    assert violations({module: edges}) == [f"{module} imports {bad} ({kind})"]


def test_a_cycle_is_found():
    assert cycles({"fp_dcp.tools.cli": {"fp_dcp.tools.verify"}, "fp_dcp.tools.verify": {"fp_dcp.tools.cli"}})
