"""The repository's documents stand on their own and say what the code is.

- README is at most 12,000 bytes, in the order a newcomer needs it: what and why, turning it on in verl (first
  screen), the two set-up commands, the main jobs, the API, the error contract, results, the layout;
- its layout section names every folder of the package, as ``tests/test_layering.py`` groups them;
- no file cites a document a clone does not have (the notes the project was specified from live outside it).
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
