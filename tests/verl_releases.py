"""Every verl release from 0.6.1 to 0.9.1, from its PyPI wheel, for the tests that hold the drop-ins to each.

``release_dir(version)`` is the unpacked wheel (``verl/`` and its dist-info), downloaded with
``pip download --no-deps verl==X`` into ``$VERL_CPPACK_CACHE/verl-wheels`` (default ``~/.cache/verl_cppack``) the
first time and kept there. A download that cannot happen fails the test that needs it, saying why;
``VERL_CPPACK_OFFLINE=1`` turns that into a skip (a machine known to have no index).

``load_util(version)`` loads that release's ``verl/models/mcore/util.py`` beside the installed verl, under the
module name ``verl_release_util_<version>`` (its own imports — megatron, ``verl.utils.model``,
``verl.utils.device`` — resolve to the installed packages, which every release's util accepts).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.stacks import STACK
from verl_cppack.integrations.verl.comparison import TESTED_RELEASES

RELEASES = TESTED_RELEASES  # every verl on PyPI from 0.6.1 to 0.9.1
# the releases tested on this stack: every one on the pinned stack; on the current one the release its users run
RELEASES_UNDER_TEST = RELEASES if STACK == "pinned" else ("0.9.1",)
OFFLINE_ENV = "VERL_CPPACK_OFFLINE"
UTIL_PATH = Path("verl") / "models" / "mcore" / "util.py"


def cache_dir() -> Path:
    root = os.environ.get("VERL_CPPACK_CACHE", "").strip()
    return (Path(root) if root else Path.home() / ".cache" / "verl_cppack") / "verl-wheels"


def _wheel(version: str) -> Path:
    folder = cache_dir()
    found = sorted(folder.glob(f"verl-{version}-*.whl"))
    if found:
        return found[0]
    if os.environ.get(OFFLINE_ENV, "").strip() in ("1", "true", "yes"):
        pytest.skip(f"verl {version}'s wheel is not in {folder} and {OFFLINE_ENV} is set")
    folder.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        f"verl=={version}",
        "-d",
        str(folder),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    found = sorted(folder.glob(f"verl-{version}-*.whl"))
    if result.returncode != 0 or not found:
        pytest.fail(
            f"could not download verl {version}'s wheel into {folder} ({' '.join(command)} exited "
            f"{result.returncode}): {result.stderr.strip()[-1500:]}\n"
            f"put the wheel there by hand, or set {OFFLINE_ENV}=1 to skip the release tests",
            pytrace=False,
        )
    return found[0]


def release_dir(version: str) -> Path:
    """The unpacked wheel of verl ``version`` (a folder holding ``verl/``), made once and cached."""
    target = cache_dir() / f"verl-{version}"
    if not (target / UTIL_PATH).is_file():
        wheel = _wheel(version)
        staging = target.with_name(target.name + f".partial-{os.getpid()}")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(staging)
        if not (staging / UTIL_PATH).is_file():
            pytest.fail(f"{wheel} holds no {UTIL_PATH}", pytrace=False)
        try:
            staging.rename(target)
        except OSError:  # another process unpacked it first
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    return target


def module_name(version: str) -> str:
    return "verl_release_util_" + version.replace(".", "_")


def load_util(version: str, directory: Path | None = None) -> ModuleType:
    """verl ``version``'s util module, loaded from ``directory`` (default ``release_dir(version)``) once per process."""
    name = module_name(version)
    if name in sys.modules:
        return sys.modules[name]
    path = (directory if directory is not None else release_dir(version)) / UTIL_PATH
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
