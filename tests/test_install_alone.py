"""verl_cppack installs into a Python environment that has torch alone, and its core runs there.

A fresh virtual environment (no system site packages), ``pip install torch==2.13.0``, then ``pip install`` of this
repository without extras: the declared dependencies are all the core needs (numpy, numba and packaging come with
it).
README's core example runs there with the values its comments promise; what needs megatron-core or verl says what
to install, in one ``ImportError``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a virtual environment and two pip installs: minutes

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"


def readme_core_example() -> str:
    """The self-contained head of README's core example: its imports and the plan of three sequences (the lines
    before the part that reads megatron's parallel state)."""
    section = (ROOT / "README.md").read_text().split("## The core in one example", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    return "\n\n".join(block.split("\n\n")[:2])


CHECK = r"""
import json, re, sys
example = sys.argv[1]
namespace = {}
exec(example, namespace)
promised = {}
for line in example.splitlines():  # `plan.x   # [0, 4, 8, 16]: ...` -> the promised value of plan.x
    found = re.match(r"^(plan\.\w+)\s+# (\[[0-9, ]+\])", line)
    if found:
        promised[found.group(1)] = json.loads(found.group(2))
got = {name: eval(name, namespace).tolist() for name in promised}
errors = {}
for statement in ("import verl_cppack.verl_plugin",
                  "from verl_cppack.integrations.megatron import parallel_context_from_megatron; parallel_context_from_megatron()"):
    try:
        exec(statement, {})
        errors[statement] = None
    except ImportError as error:
        errors[statement] = str(error)
import importlib.metadata as md
print(json.dumps({"promised": promised, "got": got, "errors": errors,
                  "installed": sorted(d.metadata["Name"].lower() for d in md.distributions())}))
"""


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("alone")
    subprocess.run([sys.executable, "-m", "venv", str(folder / "venv")], check=True, timeout=300)
    python = folder / "venv" / "bin" / "python"
    source = folder / "src"  # only what a source distribution holds: no build output lands in the repository
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "verl_cppack", source / "verl_cppack", ignore=shutil.ignore_patterns("__pycache__"))
    for command in ([TORCH], [str(source)]):
        result = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *command], capture_output=True, text=True, timeout=1200
        )
        assert result.returncode == 0, f"pip install {' '.join(command)} failed:\n{result.stderr[-3000:]}"
    return python


def test_the_core_example_runs_with_torch_alone(venv_python, tmp_path):
    example = readme_core_example()
    assert "plan_from_lengths([4, 3, 6]" in example
    result = subprocess.run(
        [str(venv_python), "-c", CHECK, example], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = __import__("json").loads(result.stdout.strip().splitlines()[-1])
    assert report["promised"] == {
        "plan.cu_seqlens_padded": [0, 4, 8, 16],
        "plan.local_index": [0, 3, 4, 7, 8, 9, 14, 15],
    }
    assert report["got"] == report["promised"]
    installed = set(report["installed"])
    assert {"torch", "numpy", "numba", "packaging", "verl-cppack"} <= installed
    assert not installed & {"verl", "megatron-core", "ray"}, installed


def test_without_verl_the_plugin_raises_one_import_error_naming_what_to_install(venv_python, tmp_path):
    result = subprocess.run(
        [str(venv_python), "-c", CHECK, readme_core_example()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = __import__("json").loads(result.stdout.strip().splitlines()[-1])["errors"]
    plugin, megatron = errors.values()
    assert plugin is not None and re.search(r"verl, which is not installed.*pip install 'verl-cppack\[verl\]'", plugin)
    assert megatron is not None and "pip install megatron-core" in megatron
