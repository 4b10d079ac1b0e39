"""The package's dependencies point one way, and no module imports itself back round a cycle.

Every module of ``verl_cppack`` is parsed with ``ast`` (nothing is imported). Each belongs to a layer; a module
may import its own layer and the layers below, never a layer above, not even inside a function or under
``TYPE_CHECKING``. Runtime imports (``TYPE_CHECKING`` blocks excluded) form no cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "verl_cppack"

# Lowest first. The all-gather (collectives) only knows the context; the packing plan all-gathers in ``unpack``.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("verl_cppack.context", "verl_cppack.core")),
    ("collectives", ("verl_cppack.collectives",)),
    ("packing", ("verl_cppack.packing", "verl_cppack.attention", "verl_cppack.loss")),
    ("integrations", ("verl_cppack.integrations", "verl_cppack.logprobs", "verl_cppack.verl_plugin")),
    (
        "jobs/CLI",
        ("verl_cppack.jobs", "verl_cppack.cli", "verl_cppack.bench", "verl_cppack"),
    ),  # the package: the public API
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    """Index in ``LAYERS`` of the longest prefix naming ``module``."""
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no layer: add it to LAYERS"
    return max(matches)[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    """(imported verl_cppack module, line, under ``TYPE_CHECKING``) for every import statement, at any depth."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, type_checking) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:  # ``from package import submodule`` imports the submodule
                submodule = f"{base}.{alias.name}"
                found.append((submodule if submodule in MODULES else base, node.lineno, type_checking))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(tree, False)
    return [(name, line, tc) for name, line, tc in found if name == "verl_cppack" or name.startswith("verl_cppack.")]


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 50
    for module in MODULES:
        layer_of(module)


def test_imports_point_down_the_layers():
    """core -> collectives -> packing -> integrations -> jobs/CLI: nothing imports a layer above its own,
    lazily inside a function or for type checking included."""
    upward = {
        f"{MODULES[module].relative_to(PACKAGE_ROOT.parent)}:{line} ({LAYERS[layer_of(module)][0]}) imports "
        f"{imported} ({LAYERS[layer_of(imported)][0]})"
        for module in MODULES
        for imported, line, _ in imports_of(module)
        if layer_of(imported) > layer_of(module)
    }
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("layer", ["core", "collectives", "packing"])
def test_lower_layers_never_name_integrations_jobs_or_cli(layer):
    """The rule the layer order implies, spelt out for the layers the brief names (context.py is in core)."""
    index = [name for name, _ in LAYERS].index(layer)
    forbidden = ("verl_cppack.integrations", "verl_cppack.jobs", "verl_cppack.cli")
    for module in (m for m in MODULES if layer_of(m) == index):
        for imported, line, _ in imports_of(module):
            assert not imported.startswith(forbidden), f"{module}:{line} imports {imported}"


def test_no_import_cycles():
    """Runtime imports (any depth, ``TYPE_CHECKING`` excluded) between modules form no cycle. A package's
    ``__init__`` importing its own submodules is how a package exposes them and is left out."""
    graph = {
        module: {
            imported
            for imported, _, type_checking in imports_of(module)
            if not type_checking and imported != module and not imported.startswith(module + ".")
        }
        for module in MODULES
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                cycle = path[path.index(imported) :] + [imported]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if imported in graph and imported not in state:
                visit(imported)
        path.pop()
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module)
