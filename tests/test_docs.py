"""The repository's documents stand on their own and say what the code is.

- README is at most 12,000 bytes, in the order a newcomer needs it: what and why, turning it on in verl (first
  screen), the two set-up commands, the main jobs, the API, the error contract, results, the layout;
- its layout section names every folder of the package, as ``tests/test_layering.py`` groups them;
- no file cites a document a clone does not have (the notes the project was specified from live outside it);
- every link between README and docs/ reaches a file and a heading there, and every path or module of this
  repository the documents name exists (``core/runs.count_up``: the module, and that name in it).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The planning documents of the project's first sessions (not in a clone), and their folder: any mention of them is
# a citation a reader cannot follow. Spelt with character classes so that this file does not mention them itself.
_PLANNING_DOC = r"[D]ESIGN(\.md| §)|[V]ERL_ON_CPU"
OUTSIDE = re.compile(rf"{_PLANNING_DOC}|[s]eed[- ]0\d\d|(\.\./|^|\s)[s]hared/", re.MULTILINE)


def test_readme_is_short_and_in_a_newcomers_order():
    assert len(README.encode()) <= 12_000
    sections = re.findall(r"^## (.+)$", README, flags=re.MULTILINE)
    order = [
        "Turn it on in verl",
        "Set-up: the two commands",
        "The main jobs",
        "The core in one example",
        "Errors",
        "Results",
        "Layout",
    ]
    positions = [next(i for i, section in enumerate(sections) if section.startswith(name)) for name in order]
    assert positions == sorted(positions) and positions[0] == 0, sections
    assert README.index("external_lib=verl_cppack.verl_plugin") < 2500  # on the first screen
    assert "make run" in README and "make test" in README


def test_the_layout_names_every_folder_of_the_package():
    layout = README[README.index("## Layout") :]
    for folder in sorted(p.parent.name for p in (ROOT / "verl_cppack").glob("*/__init__.py")):
        assert f"{folder}/" in layout, folder


def test_no_file_cites_a_document_outside_the_repository():
    cited = [
        f"{path.relative_to(ROOT)}:{number}"
        for pattern in ("*.py", "*.md", "*.sh", "*.toml")
        for path in ROOT.rglob(pattern)
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line) and path.name != "test_docs.py"
    ]
    assert not cited, cited


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE = ROOT / "verl_cppack"
TOP_FOLDERS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
PACKAGE_FOLDERS = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
PACKAGE_MODULES = {p.stem: p for p in PACKAGE.rglob("*.py") if p.stem != "__init__"}
# paths of other projects' repositories that the documents name (verl's own unit tests)
EXTERNAL = {"tests/utils/test_megatron_bshd_preprocess.py"}


def _anchors(document: Path) -> set[str]:
    """GitHub's anchors of ``document``'s headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    headings = re.findall(r"^#+ (.+)$", document.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-") for heading in headings}


def _names(path: Path, name: str) -> bool:
    return path.is_file() and re.search(rf"\b{re.escape(name)}\b", path.read_text()) is not None


def _path_exists(token: str) -> bool:
    """``a/b.py``, ``a/b/`` or ``a/b.name`` under the repository, the package or tests/."""
    token = token.rstrip("/")
    if any((base / token).exists() for base in (ROOT, PACKAGE, ROOT / "tests")):
        return True
    module, _, name = token.rpartition(".")
    return any(_names(base / f"{module}.py", name) for base in (ROOT, PACKAGE))


def _module_exists(token: str) -> bool:
    """``verl_cppack.a.b.name``, ``integrations.a.name`` or ``module.name`` for a module of the package."""
    parts = token.split(".")
    if parts[0] == "verl_cppack":
        parts = parts[1:]
    base = PACKAGE
    while parts and (base / parts[0] / "__init__.py").is_file():
        base = base / parts.pop(0)
    if not parts:
        return True
    if (base / f"{parts[0]}.py").is_file():
        module = base / f"{parts.pop(0)}.py"
        return not parts or _names(module, parts[0])
    return _names(base / "__init__.py", parts[0])


def _broken_references(document: Path) -> list[str]:
    text, broken = document.read_text(), []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"link {target}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"anchor {target}")
    for token in re.findall(r"`([^`\s]+)`", text):
        token = re.sub(r"\(.*$", "", token)
        first = token.split("/")[0].split(".")[0]
        if "/" in token and first in TOP_FOLDERS | PACKAGE_FOLDERS and token not in EXTERNAL:
            ok = _path_exists(token)
        elif re.fullmatch(r"test_\w+\.py", token):
            ok = (ROOT / "tests" / token).is_file()
        elif re.fullmatch(r"\w+(\.\w+)+", token) and (first == "verl_cppack" or first in PACKAGE_FOLDERS):
            ok = _module_exists(token)
        elif re.fullmatch(r"\w+\.\w+", token) and first in PACKAGE_MODULES and not token.endswith((".py", ".md")):
            ok = _names(PACKAGE_MODULES[first], token.split(".")[1])
        else:
            continue
        if not ok:
            broken.append(f"name {token}")
    return broken


def test_the_documents_links_and_named_paths_exist():
    broken = [
        f"{document.relative_to(ROOT)}: {reference}"
        for document in DOCUMENTS
        for reference in _broken_references(document)
    ]
    assert not broken, broken


def test_the_reference_checker_can_fail(tmp_path):
    document = tmp_path / "doc.md"
    document.write_text(
        "# Title\n[a](doc.md#title) [b](doc.md#missing) [c](gone.md) `core/runs.count_up` `core/runs.no_such_name` "
        "`test_no_such_file.py` `verl_cppack.core.runs.count_up` `verl_cppack.core.nothing_here` `checks.require_true` "
        "`checks.no_such_check` `benchmarks/no_such_script.py`\n"
    )
    assert _broken_references(document) == [
        "anchor doc.md#missing",
        "link gone.md",
        "name core/runs.no_such_name",
        "name test_no_such_file.py",
        "name verl_cppack.core.nothing_here",
        "name checks.no_such_check",
        "name benchmarks/no_such_script.py",
    ]
