"""``verl-cppack doctor``: versions, the verl util API generation, and whether (and where) the patch is in.

By default nothing heavy is imported: versions come from package metadata, the verl API generation and which of
verl's packing functions the drop-ins stand in for (and why any util function is left to verl: a parameter the drop-in
does not know, or no drop-in for it) from ``verl/models/mcore/util.py`` read with ``ast``. ``--verify`` installs the
patch here, imports verl's caller modules and lists which hold the drop-ins, then calls each replaced function on
random batches at CP=1 through the runtime check (``self_check``: ``runtime_check.VerifiedDropIn``, as an untested
release's first calls are checked), which puts back any whose results differ from verl's beyond the intended
differences; it exits 1 when a util function is left to verl or put back, a caller is not covered or a CPU fix is
refused. ``--json`` prints the report alone on standard output (what libraries print meanwhile goes to standard error).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from verl_cppack.cli import add_command
from verl_cppack.runtime.checked_fix import installed_version

# label -> its distributions, the first one installed giving the version (names match as pip normalizes them)
LABELS = ("torch", "verl", "megatron-core", "transformer-engine", "flash-attn", "megatron-bridge", "verl-cppack")
DISTRIBUTIONS = {label: (label,) for label in LABELS}
DISTRIBUTIONS["transformer-engine"] += ("transformer-engine-torch",)
CALLER_MODULES = (
    "verl.models.mcore.model_forward",
    "verl.models.mcore.model_forward_fused",
    "verl.models.mcore.model_forward_1f1b_overlap",
    "verl.utils.megatron.router_replay_utils",
    "verl.trainer.distillation.megatron.losses",
)


def installed_versions() -> dict[str, str | None]:
    return {label: next(filter(None, map(installed_version, names)), None) for label, names in DISTRIBUTIONS.items()}


def _import_errors(modules: Iterable[str]) -> dict[str, str]:
    """Import each module here; the error of each that could not be imported, by module."""
    errors = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - e.g. Transformer Engine missing on a CPU machine
            errors[module] = f"{type(error).__name__}: {error}"
    return errors


def util_source_path() -> Path | None:
    """``verl/models/mcore/util.py`` without importing verl (``find_spec`` of a top-level name imports nothing)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "mcore" / "util.py"
    return path if path.is_file() else None


def generation_from_source(path: Path) -> dict[str, Any]:
    """From util's source, as ``install`` would decide (``patching``): the API generation, the functions the drop-ins
    stand in for (``replaceable``) and those left to verl with the reason (``left_to_verl``)."""
    from verl_cppack.integrations.verl.comparison import NOT_PACKING
    from verl_cppack.integrations.verl.patching import DROPINS, VerlFunction, detect_generation, plan_replacements

    tree = ast.parse(path.read_text())
    defined = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    functions = {node.name: VerlFunction.from_source(node) for node in defined if node.name in DROPINS}
    chosen, left = plan_replacements(functions)
    unknown = [node.name for node in defined if not node.name.startswith("_") and node.name not in DROPINS]
    left.update({name: "no drop-in knows this function" for name in unknown if name not in NOT_PACKING})
    return {
        "generation": detect_generation(functions),
        "util": str(path),
        "replaceable": sorted(chosen),
        "left_to_verl": dict(sorted(left.items())),
    }


def cpu_fix_report(verify: bool) -> list[dict[str, Any]]:
    """The CPU fixes for verl's trainer: target, version range, whether the installed version is in it, and with
    ``verify`` whether each applied here (the fixes are armed and their modules imported in this process)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from verl_cppack import runtime
    from verl_cppack.runtime.cpu_fixes import FIXES

    if verify:
        runtime.activate()
        _import_errors(fix.module for fix in FIXES)  # a refused fix or a missing package shows up in its state
    states = {status.fix.name: status for status in runtime.report()}
    rows = []
    for fix in FIXES:
        installed, status = installed_version(fix.distribution), states.get(fix.name)
        state, detail = (status.state, status.detail) if status else ("not armed", "")
        version_ok = installed is not None and Version(installed) in SpecifierSet(fix.versions)
        row = {key: getattr(fix, key) for key in ("name", "fixes", "module", "distribution", "versions")}
        rows.append({**row, "installed": installed, "version_ok": version_ok, "state": state, "detail": detail})
    return rows


def bridge_report(verify: bool) -> dict[str, Any]:
    """Megatron-Bridge's packing copies (``integrations.megatron_bridge``): read from its source, and with ``verify``
    imported (where Transformer Engine lets the bridge import) to list where ours is bound."""
    from verl_cppack.integrations import megatron_bridge

    report: dict[str, Any] = {"from_source": megatron_bridge.source_report()}
    if verify and report["from_source"]:
        modules = {copy.module for copy in megatron_bridge.COPIES} | {megatron_bridge.QWEN3_VL + ".model"}
        report["import_errors"] = _import_errors(sorted(modules))
        report["in_this_process"] = megatron_bridge.status()
    return report


@contextlib.contextmanager
def _one_rank_world() -> Iterator[None]:
    """A gloo world of this process alone and megatron's parallel state at TP=CP=1, unless both are there."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    started_world = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="verl_cppack_self_check_") as folder:
        if started_world:
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        started_state = not mpu.model_parallel_is_initialized()
        try:
            if started_state:
                mpu.initialize_model_parallel()
            if mpu.get_context_parallel_world_size() != 1:
                raise ValueError("the self-check compares at CP=1; run it in a process whose megatron CP size is 1")
            yield
        finally:
            if started_state:
                mpu.destroy_model_parallel()
            if started_world:
                dist.barrier()
                dist.destroy_process_group()


def self_check(batches: tuple[tuple[int, int], ...] = ((11, 1), (13, 2))) -> None:
    """Every function ``install`` replaced, called on random batches (``(seed, shortest row)``) through the runtime
    check, which puts verl's back where they differ (``patching.status()["put_back"]`` names them, with the
    difference)."""
    import inspect

    import torch

    from verl_cppack.bench.batches import rollout_batch
    from verl_cppack.integrations.verl import patching
    from verl_cppack.integrations.verl.runtime_check import VerifiedDropIn

    originals, ours, release = patching.originals(), patching.dropin_functions(), patching.status()["release"]

    def call(name: str, *args: Any, **kwargs: Any) -> Any:
        if name not in originals:
            return None
        function = originals[name]
        if name in patching.originals():
            function = VerifiedDropIn(name, function, ours[name], release, on_put_back=patching.put_back)
        try:
            return function(*args, **kwargs)
        except Exception:  # noqa: BLE001 - both raised (bad input for both): nothing to compare
            return None

    def output(rows: torch.Tensor) -> torch.Tensor:
        return torch.randn(*rows.shape[:2], 4)

    with _one_rank_world():
        for seed, shortest in batches:
            ids, mask = rollout_batch(6, 14, padding="anywhere", shortest=shortest, vocab_size=1000, seed=seed)
            (batch, seq_len), positions = mask.shape, mask.long().cumsum(1) - 1
            nested, labels = (
                torch.nested.nested_tensor([row[keep] for row, keep in zip(x, mask)], layout=torch.jagged)
                for x in (ids, torch.roll(ids, -1, 1))
            )
            if (packed := call("preprocess_packed_seqs", ids, mask)) is not None:
                call("postprocess_packed_seqs", output(packed[0]), packed[1], mask, batch, seq_len)
            label_mask = call("preprocess_packed_seqs", torch.roll(mask, -1, 1) & mask, mask)
            if label_mask is not None and "postprocess_packed_seqs_for_dict_output" in originals:
                from verl.utils.model import CausalLMOutputForPPO

                n = label_mask[0].shape[1]
                out = CausalLMOutputForPPO(log_probs=-torch.rand(n), entropy=torch.rand(n))
                call("postprocess_packed_seqs_for_dict_output", label_mask[0], out, label_mask[1], mask, batch, seq_len)
            for pre, post in (("preprocess_bshd", "postprocess_bshd"), ("remove_left_padding", "recover_left_padding")):
                if (rows := call(pre, ids, mask, positions, False)) is not None:
                    call(post, output(rows[1]), rows[1], mask, seq_len)
            for kind in ("thd_engine", "thd_no_padding", "packed_seqs_no_padding", "bshd_engine", "bshd_no_padding"):
                pre, post = f"preprocess_{kind}", f"postprocess_{kind}"
                if pre in originals and "need_roll" in inspect.signature(originals[pre]).parameters:
                    call(pre, labels, need_roll=True)
                if (packed := call(pre, nested)) is not None and "bshd" not in kind:
                    call(post, output(packed[0]), packed[1], nested, batch)
                elif packed is not None:
                    call(post, output(packed[1]), packed[1])
            call("build_vlm_attn_mask_thd", nested, 0)
            call("build_vlm_attn_mask_bshd", nested, batch, 0)


def collect(verify: bool) -> dict[str, Any]:
    from verl_cppack.integrations.verl import patching

    report: dict[str, Any] = {"versions": installed_versions()}
    path = util_source_path()
    report["verl_util"] = generation_from_source(path) if path is not None else None
    report["environment"] = {name: os.environ.get(name) for name in ("VERL_USE_EXTERNAL_MODULES", patching.DISABLE_ENV)}
    if verify and path is not None:
        report["install_returned"] = patching.install()
        report["import_errors"] = _import_errors(CALLER_MODULES)
        try:
            self_check()
        except Exception as error:  # noqa: BLE001 - a check that cannot run is reported, not a crash of doctor
            report["self_check_error"] = f"{type(error).__name__}: {error}"
    report["patch"] = patching.status()
    report["megatron_bridge"] = bridge_report(verify)
    report["cpu_fixes"] = cpu_fix_report(verify)
    return report


def _print_human(report: dict[str, Any]) -> None:
    print("versions:")
    for name, version in report["versions"].items():
        print(f"  {name:20s} {version or 'not installed'}")
    util = report["verl_util"]
    if util is None:
        print("verl util: not found (verl not installed)")
    else:
        print(f"verl util API generation: {util['generation']}  ({util['util']})")
        print(f"  replaceable names: {', '.join(util['replaceable'])}")
        for name, reason in util["left_to_verl"].items():
            print(f"  left to verl: {name} ({reason})")
    print("environment: " + ", ".join(f"{k}={v!r}" for k, v in report["environment"].items()))
    patch = report["patch"]
    print(f"patch installed in this process: {patch['installed']} (generation {patch['generation']})")
    for module, names in patch["covered"].items():
        print(f"  {module}: {', '.join(names)}")
    for name, reason in patch.get("left_to_verl", {}).items():
        print(f"  left to verl in this process: {name} ({reason})")
    for name, reason in patch.get("put_back", {}).items():
        print(f"  put back to verl's own in this process (its results differ): {name} ({reason})")
    if patch.get("verifying"):
        print(f"  the drop-ins verify themselves on their first calls (verl {patch.get('release')})")
    if "self_check_error" in report:
        print(f"  could not compare the drop-ins with verl's functions: {report['self_check_error']}")
    for module, error in report.get("import_errors", {}).items():
        print(f"  could not import {module}: {error}")
    bridge = report["megatron_bridge"]
    if bridge["from_source"]:
        print(f"Megatron-Bridge's packing copies ({', '.join(sorted(bridge['from_source']))}):")
        for name, fate in bridge["from_source"].items():
            fate = "replaced when the plugin is on" if fate == "replaced" else f"left to the bridge: {fate}"
            print(f"  {name}: {fate}")
        for module, error in bridge.get("import_errors", {}).items():
            print(f"  could not import {module}: {error}")
        for name, modules in bridge.get("in_this_process", {}).get("replaced", {}).items():
            print(f"  {name} bound in this process: {', '.join(modules)}")
    print("CPU support for verl's trainer (armed by VERL_PLATFORM=cpu; --verify applies it here):")
    for row in report["cpu_fixes"]:
        version = f"{row['distribution']} {row['installed'] or 'not installed'} (written for {row['versions']})"
        print(f"  {row['name']:28s} {row['state']:10s} {version}  {row['module']}: {row['fixes']}")
        if row["detail"]:
            print(f"      {row['detail']}")
    if not patch["installed"]:
        print(
            "turn it on with actor_rollout_ref.model.external_lib=verl_cppack.verl_plugin "
            "(or VERL_USE_EXTERNAL_MODULES=verl_cppack.verl_plugin); check with `verl-cppack doctor --verify`"
        )


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Standard output (``sys.stdout`` and file descriptor 1: vLLM's handler and C code) to standard error inside
    the block, so that ``--json`` prints the report alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        report = collect(args.verify)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_human(report)
    if not args.verify:
        return 0
    util, patch = report["verl_util"], report["patch"]
    if util is None or not patch["installed"]:
        return 1
    missing = [module for module in CALLER_MODULES if module not in {**patch["covered"], **report["import_errors"]}]
    refused = [row["name"] for row in report["cpu_fixes"] if row["state"] not in ("applied", "not needed")]
    left = patch.get("left_to_verl") or util["left_to_verl"]
    return 1 if missing or refused or left or patch.get("put_back") or "self_check_error" in report else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "doctor", "versions, verl API generation, and where the verl patch is installed", __doc__, run
    )
    parser.add_argument(
        "--verify", action="store_true", help="install the patch here, import verl's callers, list coverage"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
