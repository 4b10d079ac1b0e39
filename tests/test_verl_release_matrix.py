"""Every verl release from 0.6.1 to 0.9.1: its own packing functions against the drop-ins, and the plugin in it.

For each release (``tests.verl_releases``: its PyPI wheel, cached):

- **equality**, in one 2-rank gloo world: the release's ``verl/models/mcore/util.py`` is loaded beside the
  installed verl, the plugin picks a drop-in for each of its packing functions (``patching.plan_replacements``,
  exactly as ``install`` does), and each pair runs on random batches (padding anywhere: left, right, middle, gaps;
  1-token sequences) at CP=2, then at CP=1 in the same processes (the BSHD functions of verl < 0.8 refuse CP>1).
  Every difference found must be one ``comparison.INTENDED_DIFFERENCES`` lists for that release, and every one
  listed there that random batches can show must show.
- **the plugin**, in a fresh interpreter with the release importable as ``verl``: every module of the release
  that binds a util packing function holds the drop-in after ``import verl_cppack.verl_plugin``, and none is
  left to verl.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.distributed import run_gloo
from tests.verl_releases import RELEASES_UNDER_TEST, load_util, release_dir
from verl_cppack.integrations.verl.comparison import NOT_PACKING, difference_key, intended_keys

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

# each release's wheel, fetched, in gloo and in a subprocess: minutes; on the current stack verl 0.9.1 alone
pytestmark = [pytest.mark.slow, pytest.mark.stacks]

# (seed, shortest sequence): verl < 0.8 crashes on 1-token sequences under CP; empty ones appear with shortest 0
BATCHES = ((11, 1), (12, 1), (13, 2), (14, 2), (15, 0))
# the intended differences random valid batches cannot show (tests/test_verl_fixes.py checks ours there)
UNOBSERVABLE = {"integer-masks", "unaligned-stream", "empty-batch", "vlm-bad-sizes", "dynamic-cp-getter", "npu"}


# ------------------------------------------------------------------------------------------------ equality
def _compare_worker(rank: int, world_size: int, directories: dict[str, str]) -> dict:
    """In one gloo rank: every release at CP=2, then at CP=1."""
    from megatron.core import parallel_state as mpu

    from tests.verl_release_harness import compare_release
    from verl_cppack.integrations.verl import clear_plan_caches, patching

    results: dict = {}
    for cp_size in (world_size, 1):
        mpu.initialize_model_parallel(context_parallel_size=cp_size)
        try:
            cp_rank = mpu.get_context_parallel_rank()
            for version, directory in directories.items():
                util = load_util(version, Path(directory))
                chosen, left = patching.plan_replacements(patching.util_functions(util))
                ours = {name: dropin.function for name, dropin in chosen.items()}
                clear_plan_caches()
                comparison = compare_release(util, ours, cp_size, cp_rank, BATCHES)
                results[version, cp_size] = {
                    "chosen": {name: dropin.function.__name__ for name, dropin in chosen.items()},
                    "left": left,
                    "compared": comparison.compared,
                    "findings": [(f.function, f.case, f.where, f.detail) for f in comparison.findings],
                }
        finally:
            mpu.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def directories() -> dict[str, str]:
    return {version: str(release_dir(version)) for version in RELEASES_UNDER_TEST}


@pytest.fixture(scope="module")
def compared(directories) -> list[dict]:
    return run_gloo(_compare_worker, 2, directories)


def test_every_release_has_a_drop_in_for_every_packing_function(directories, compared):
    expected_counts = {"0.6.1": 7, "0.7.0": 9, "0.7.1": 9, "0.8.0": 11, "0.9.0": 11, "0.9.1": 11}
    for version in RELEASES_UNDER_TEST:
        util_source = (Path(directories[version]) / "verl" / "models" / "mcore" / "util.py").read_text()
        public = set(re.findall(r"^def ([a-z]\w*)\(", util_source, flags=re.MULTILINE)) - NOT_PACKING
        for result in compared:
            entry = result[version, 2]
            assert entry["left"] == {}, (version, entry["left"])
            assert set(entry["chosen"]) == public, (version, sorted(public - set(entry["chosen"])))
            assert len(public) == expected_counts[version], (version, sorted(public))


def test_every_difference_from_each_release_is_an_intended_one(compared):
    listed = {version: intended_keys(version) for version in RELEASES_UNDER_TEST}
    unexplained, seen = [], defaultdict(set)
    for result in compared:
        for (version, cp_size), entry in result.items():
            for function, case, where, detail in entry["findings"]:
                key = difference_key(function, where, cp_size)
                seen[version].add(key)
                if key not in listed[version]:
                    unexplained.append(f"verl {version} CP={cp_size} {function} [{case}] {where}: {detail} (key {key})")
    assert not unexplained, "differences not intended:\n" + "\n".join(sorted(set(unexplained))[:60])
    never_seen = [
        f"verl {version}: {key}"
        for version in RELEASES_UNDER_TEST
        for key in sorted(listed[version] - UNOBSERVABLE - seen[version])
    ]
    assert not never_seen, "intended differences these releases never showed:\n" + "\n".join(never_seen)


def test_each_function_was_compared_at_both_cp_sizes(compared):
    """No packing function escapes comparison (a verl that crashes on every batch would compare nothing)."""
    for result in compared:
        for (version, cp_size), entry in result.items():
            for name in entry["chosen"]:
                cp1_only = name in (
                    "preprocess_bshd",
                    "postprocess_bshd",
                    "remove_left_padding",
                    "recover_left_padding",
                ) or (name.endswith("bshd_no_padding") and version in ("0.7.0", "0.7.1"))
                if cp_size > 1 and cp1_only:
                    continue  # verl refuses CP>1 there (an assertion), as ours does (ValueError)
                assert entry["compared"].get(name, 0) > 0, (version, cp_size, name, entry["compared"])


# ------------------------------------------------------------------------------------------------ the plugin
PLUGIN_SCRIPT = r"""
import ast, importlib, json, sys
from pathlib import Path
release = Path(sys.argv[1])
sys.path.insert(0, str(release))
import transformers
if not hasattr(transformers, "AutoModelForVision2Seq"):  # verl 0.6.1 / 0.7.0 import it; transformers 5 renamed it
    transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
import verl_cppack.verl_plugin
from verl_cppack.integrations.verl import patching
from verl_cppack.integrations.verl.comparison import NOT_PACKING
UTIL = "verl.models.mcore.util"
util = importlib.import_module(UTIL)
assert Path(util.__file__).resolve().is_relative_to(release.resolve()), util.__file__
packing = {node.name for node in ast.parse(Path(util.__file__).read_text()).body  # util's public functions
           if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")} - NOT_PACKING

def resolved(module, node):  # the absolute module a `from ... import` names
    if not node.level:
        return node.module or ""
    package = module.split(".") if module_paths[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)

module_paths = {".".join(p.relative_to(release).with_suffix("").parts).removesuffix(".__init__"): p
                for p in sorted((release / "verl").rglob("*.py"))}
importers = {}
for module, path in module_paths.items():
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and resolved(module, node) == UTIL:
            names = {alias.name for alias in node.names} & packing
            if names:
                importers.setdefault(module, set()).update(names)
errors = {}
for module in importers:
    try:
        importlib.import_module(module)
    except Exception as error:
        errors[module] = f"{type(error).__name__}: {error}"

def ours(value):
    return getattr(value, "__module__", "").startswith("verl_cppack.")

not_ours = {module: sorted(name for name in names if not ours(getattr(sys.modules[module], name)))
            for module, names in importers.items() if module in sys.modules}
print(json.dumps({
    "packing": sorted(packing), "replaced": sorted(patching.originals()), "left": patching.status()["left_to_verl"],
    "importers": {m: sorted(n) for m, n in importers.items()}, "errors": errors,
    "not_ours": {m: n for m, n in not_ours.items() if n}, "util_not_ours": sorted(n for n in packing if not ours(getattr(util, n))),
}))
"""


@pytest.mark.parametrize("version", RELEASES_UNDER_TEST)
def test_the_plugin_replaces_every_packing_function_in_every_module_of_the_release(version, directories):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_CPPACK_DISABLE", "VERL_PLATFORM")
    }
    result = subprocess.run(
        [sys.executable, "-c", PLUGIN_SCRIPT, directories[version]],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, report["errors"]
    assert report["left"] == {} and report["replaced"] == report["packing"], report
    assert report["importers"], "the release has modules that import util's packing functions"
    assert report["not_ours"] == {} and report["util_not_ours"] == [], report
