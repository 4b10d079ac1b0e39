"""The package is two wings and what stands on them, and its folders say which is which.

- **the library** (what a GPU user installs and imports): ``context.py`` and ``core/`` (index math) ->
  ``collectives/`` -> ``packing/``, ``attention/``, ``loss/`` (siblings: none imports another) ->
  ``integrations/`` and ``logprobs.py`` (Megatron and verl) -> the package's public API (``verl_cppack/__init__``);
- **the CPU runtime** for verl's trainer, ``runtime/`` (platform, fixes, rollout, host-device scope, tiny GPT, engine
  without Ray): it uses only the library's public modules (``PUBLIC_LIBRARY``);
- **on top**: ``verl_plugin.py`` (verl's ``external_lib``: the library's patch, and the runtime when asked),
  ``jobs/``, ``bench/``, ``cli/``.

Every module is parsed with ``ast`` (nothing is imported). A module may import its own group and the groups below,
never a group above nor a sibling, not even inside a function or under ``TYPE_CHECKING``; the library imports
nothing of the runtime or of what stands on it. Runtime imports (``TYPE_CHECKING`` blocks excluded) form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "verl_cppack"

# (group, wing, level, module prefixes): a module may import groups of a lower level, and its own group.
GROUPS: tuple[tuple[str, str, int, tuple[str, ...]], ...] = (
    ("core", "library", 0, ("verl_cppack.context", "verl_cppack.core")),
    ("collectives", "library", 1, ("verl_cppack.collectives",)),
    ("packing", "library", 2, ("verl_cppack.packing",)),
    ("attention", "library", 2, ("verl_cppack.attention",)),
    ("loss", "library", 2, ("verl_cppack.loss",)),
    ("integrations", "library", 3, ("verl_cppack.integrations", "verl_cppack.logprobs")),
    ("public API", "library", 4, ("verl_cppack",)),
    ("runtime", "runtime", 5, ("verl_cppack.runtime",)),
    ("plugin", "top", 6, ("verl_cppack.verl_plugin",)),
    ("jobs", "top", 7, ("verl_cppack.jobs",)),
    ("bench", "top", 8, ("verl_cppack.bench",)),
    ("cli", "top", 9, ("verl_cppack.cli",)),
)
# What the runtime (and anyone outside the library) may import of it.
PUBLIC_LIBRARY = (
    "verl_cppack",
    "verl_cppack.attention",
    "verl_cppack.attention.core_attention",
    "verl_cppack.integrations",
    "verl_cppack.integrations.megatron",
    "verl_cppack.integrations.verl",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def group_of(module: str) -> tuple[str, str, int, tuple[str, ...]]:
    """The group whose longest prefix names ``module``."""
    matches = [
        (len(prefix), group)
        for group in GROUPS
        for prefix in group[3]
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no group: add it to GROUPS"
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


def test_every_module_is_in_a_group_and_every_folder_is_one():
    assert len(MODULES) > 50
    for module in MODULES:
        group_of(module)
    folders = {path.parent.name for path in PACKAGE_ROOT.glob("*/__init__.py")}
    named = {prefix.split(".")[1] for group in GROUPS for prefix in group[3] if prefix.count(".") == 1}
    assert folders <= named, f"folders without a group: {sorted(folders - named)}"


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(PACKAGE_ROOT.parent)}:{line} ({group_of(module)[0]})"


def test_imports_point_down_and_siblings_stay_apart():
    """Nothing imports a group of its own level or above but its own group, lazily or for type checking included."""
    wrong = {
        f"{_where(module, line)} imports {imported} ({group_of(imported)[0]})"
        for module in MODULES
        for imported, line, _ in imports_of(module)
        if group_of(imported) != group_of(module) and group_of(imported)[2] >= group_of(module)[2]
    }
    assert not wrong, "imports against the order:\n" + "\n".join(sorted(wrong))


def test_the_library_imports_nothing_of_the_runtime_or_what_stands_on_it():
    wrong = {
        f"{_where(module, line)} imports {imported}"
        for module in MODULES
        if group_of(module)[1] == "library"
        for imported, line, _ in imports_of(module)
        if group_of(imported)[1] != "library"
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_the_runtime_uses_only_the_librarys_public_modules():
    wrong = {
        f"{_where(module, line)} imports {imported}"
        for module in MODULES
        if group_of(module)[1] == "runtime"
        for imported, line, _ in imports_of(module)
        if group_of(imported)[1] == "library" and imported not in PUBLIC_LIBRARY
    }
    assert not wrong, "the runtime reaches into the library:\n" + "\n".join(sorted(wrong))


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


def test_an_old_import_path_readme_showed_names_the_new_one():
    """``verl_cppack.integrations.megatron_model`` (README once showed its ``build_tiny_gpt``) moved to the runtime."""
    import importlib

    with pytest.raises(ImportError, match="verl_cppack.runtime.tiny_gpt"):
        importlib.import_module("verl_cppack.integrations.megatron_model")
