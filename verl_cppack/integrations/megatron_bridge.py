"""Megatron-Bridge's own packing copies, replaced by the core and made consistent with verl's ``PackedSeqParams``.

Megatron-Bridge's ``Qwen3VLModel`` repacks what verl packed with its own copies (``COPIES``), which replacing verl's
functions never reaches; ``install()`` rebinds them where defined and where bound by name. Ours pack as verl's
``PackedSeqParams`` describe (via the mask ``build_vlm_attn_mask_thd`` returned), else as the bridge does. A copy is
replaced only while the bridge is in ``VERSIONS`` and the copy keeps the signature and line it was read for, else
``status()`` says why. Nothing here imports the bridge (it imports Transformer Engine)."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import require_mask
from verl_cppack.core.layouts import zigzag_indices
from verl_cppack.integrations import megatron
from verl_cppack.integrations.import_hooks import after_import, cancel
from verl_cppack.integrations.verl import dropins
from verl_cppack.integrations.verl.plan_cache import PLAN_ATTRIBUTE

DISTRIBUTION = "megatron-bridge"
VERSIONS = ">=0.6.0,<0.7"  # read against 0.6.2
QWEN3_VL = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl"
PACKED_SEQ_UTILS = "megatron.bridge.training.utils.packed_seq_utils"


# ------------------------------------------------------------------------------------------------ the drop-ins
def _context_of(pg_collection: Any) -> ParallelContext:
    """TP/CP of ``pg_collection``'s ``.tp`` / ``.cp`` groups (no group kept: packing needs no communication), else
    megatron's parallel state as verl reads it."""
    if pg_collection is None:
        return dropins.megatron_context()
    tp, cp = getattr(pg_collection, "tp", None), getattr(pg_collection, "cp", None)
    if tp is None or cp is None:
        raise TypeError(
            f"pg_collection must be a megatron ProcessGroupCollection with tp and cp groups, got {type(pg_collection).__name__}"
        )
    return ParallelContext(tp_size=tp.size(), cp_size=cp.size(), cp_rank=cp.rank())


def preprocess_packed_seqs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pre_process: bool = True, pg_collection: Any = None
) -> tuple[torch.Tensor, Any]:
    """``[B, S, *]`` rows + mask ``[B, S]`` -> (``[1, T/CP, *]`` packed rows or, ``pre_process=False``, the rows;
    ``PackedSeqParams``): verl's stream for verl's VLM masks, else the bridge's rule (``TP*CP*2`` slots, zigzag)."""
    mask = require_mask("attention_mask", attention_mask)
    ctx = _context_of(pg_collection)
    plan = dropins.vlm_mask_plan(mask, ctx)  # verl's stream, for the mask verl's build_vlm_attn_mask_thd made
    if plan is None:  # any other mask: the bridge's own rule
        plan = dropins.mask_plan(mask, ctx, Alignment.per_slot(ctx.default_slot_multiple))
    params = megatron.packed_seq_params(plan)
    if not pre_process:
        return input_ids, params
    return plan.pack(input_ids, name="input_ids"), params


def cp_partition_indices(
    packed_seq_params: Any, *, total_tokens: int, cp_size: int, cp_rank: int, device: torch.device, cp_group: Any = None
) -> torch.Tensor:
    """The bridge's ``get_packed_seq_cp_partition_indices``: this CP rank's ``[T/CP]`` int64 positions in the global
    stream, from the plan of params verl_cppack made (any layout), else TE's zigzag cut of their padded offsets."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"Invalid context-parallel rank {cp_rank} for size {cp_size}.")
    if cp_group is not None and (cp_group.size() != cp_size or cp_group.rank() != cp_rank):
        raise ValueError(
            f"Context-parallel group has rank {cp_group.rank()} and size {cp_group.size()}, "
            f"but rank {cp_rank} and size {cp_size} were requested."
        )
    record = getattr(packed_seq_params, PLAN_ATTRIBUTE, None)
    if record is not None:
        plan = record[1]
        if (plan.ctx.cp_size, plan.ctx.cp_rank) != (cp_size, cp_rank) or plan.total_length != total_tokens:
            raise ValueError(
                f"packed_seq_params were made for CP rank {plan.ctx.cp_rank} of {plan.ctx.cp_size} and "
                f"{plan.total_length} tokens, but rank {cp_rank} of {cp_size} and {total_tokens} tokens were asked"
            )
        return plan.local_index.to(device)
    if cp_size == 1:
        return torch.arange(total_tokens, device=device, dtype=torch.long)
    cu_seqlens_padded = dropins.given_offsets(packed_seq_params)
    if int(cu_seqlens_padded[-1]) != total_tokens:
        raise ValueError(
            f"packed_seq_params cover {int(cu_seqlens_padded[-1])} tokens, but total_tokens={total_tokens}"
        )
    return zigzag_indices(cu_seqlens_padded, cp_size, cp_rank).to(device)


# ------------------------------------------------------------------------------------------------ the binding
@dataclass(frozen=True)
class BridgeCopy:
    """A packing function of Megatron-Bridge's, what it must still look like, and what replaces it."""

    name: str
    module: str  # where it is defined
    binders: tuple[str, ...]  # modules that bind it by name at import
    parameters: tuple[str, ...]
    line: str  # a line of its body that says it is the function we read
    replacement: Callable[..., Any]


COPIES: tuple[BridgeCopy, ...] = (
    BridgeCopy(
        "preprocess_packed_seqs",
        f"{QWEN3_VL}.utils",
        (f"{QWEN3_VL}.model",),
        ("input_ids", "attention_mask", "pre_process", "pg_collection"),
        "align_size = tp_size * cp_size * 2 if cp_size > 1 else tp_size",
        preprocess_packed_seqs,
    ),
    BridgeCopy(
        "get_packed_seq_cp_partition_indices",
        PACKED_SEQ_UTILS,
        (f"{QWEN3_VL}.model",),
        ("packed_seq_params", "total_tokens", "cp_size", "cp_rank", "device", "cp_group"),
        "return get_thd_cp_partition_indices(",
        cp_partition_indices,
    ),
)


@dataclass
class BridgeState:
    installed: bool = False
    replaced: dict[str, list[str]] = field(default_factory=dict)  # copy name -> modules where ours is bound
    left_to_bridge: dict[str, str] = field(default_factory=dict)  # copy name -> why it stays the bridge's
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)


_STATE = BridgeState()
_LOCK = threading.RLock()


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def why_not(copy: BridgeCopy, parameters: tuple[str, ...] | None, source: str | None) -> str | None:
    """Why the bridge's function (parameter names and source; None: not found) must stay the bridge's, or None."""
    version = installed_version()
    if version is None or Version(version) not in SpecifierSet(VERSIONS):
        return f"{DISTRIBUTION} {version or '(no distribution)'} is not {VERSIONS}, the releases it was read for"
    if parameters is None:
        return f"{copy.module} has no function {copy.name}"
    if parameters != copy.parameters:
        return f"its parameters are {parameters}, not {copy.parameters}"
    if source is None or copy.line not in source:
        return f"its body no longer contains {copy.line!r}"
    return None


def source_report() -> dict[str, str]:
    """Each copy's fate read from the installed source, unimported: ``"replaced"`` or why not; empty without it."""
    spec = importlib.util.find_spec("megatron")
    if installed_version() is None or spec is None:
        return {}
    report = {}
    for copy in COPIES:
        relative = Path(*copy.module.split(".")[1:]).with_suffix(".py")
        files = [Path(location) / relative for location in spec.submodule_search_locations or []]
        found = next((file for file in files if file.is_file()), None)
        parameters = source = None
        if found is not None:
            text = found.read_text()
            for node in ast.parse(text).body:
                if isinstance(node, ast.FunctionDef) and node.name == copy.name:
                    arguments = node.args
                    parameters = tuple(a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs))
                    source = ast.get_source_segment(text, node)
        report[copy.name] = why_not(copy, parameters, source) or "replaced"
    return report


def _rebind(copy: BridgeCopy, module: ModuleType) -> None:
    """Bind ours where ``module`` holds the bridge's function; record it where it holds ours already."""
    with _LOCK:
        bound = vars(module).get(copy.name)
        if bound is _STATE.originals.get(copy.name) and bound is not None:
            setattr(module, copy.name, copy.replacement)
        elif bound is not copy.replacement:
            return
        modules = _STATE.replaced.setdefault(copy.name, [])
        if module.__name__ not in modules:
            modules.append(module.__name__)


def _patch_defining_module(copy: BridgeCopy, module: ModuleType) -> None:
    with _LOCK:
        original = vars(module).get(copy.name)
        if original is copy.replacement:
            return
        parameters = source = None
        if callable(original):
            parameters = tuple(inspect.signature(original).parameters)
            with contextlib.suppress(OSError, TypeError):
                source = inspect.getsource(inspect.unwrap(original))
        reason = why_not(copy, parameters, source)
        if reason is not None:
            _STATE.left_to_bridge[copy.name] = reason
            return
        _STATE.originals[copy.name] = original
        _rebind(copy, module)
        for binder in copy.binders:
            after_import(binder, _BIND[copy.name])


# one callback object per copy and kind, so that ``uninstall`` can cancel what is pending
_DEFINE = {copy.name: functools.partial(_patch_defining_module, copy) for copy in COPIES}
_BIND = {copy.name: functools.partial(_rebind, copy) for copy in COPIES}


def install() -> None:
    """Replace the bridge's copies now where their modules are loaded, else the moment they load. Idempotent."""
    with _LOCK:
        _STATE.installed = True
        for copy in COPIES:
            after_import(copy.module, _DEFINE[copy.name])


def uninstall() -> None:
    """Put the bridge's functions back wherever ours were bound, and cancel what is pending."""
    with _LOCK:
        for copy in COPIES:
            cancel(copy.module, _DEFINE[copy.name])
            for binder in copy.binders:
                cancel(binder, _BIND[copy.name])
            for module_name in _STATE.replaced.get(copy.name, []):
                module = sys.modules.get(module_name)
                if module is not None and vars(module).get(copy.name) is copy.replacement:
                    setattr(module, copy.name, _STATE.originals[copy.name])
        vars(_STATE).update(vars(BridgeState()))


def status() -> dict[str, Any]:
    """What ``verl-cppack doctor`` prints: each copy, where ours is bound, or why it stays the bridge's."""
    return {
        "installed": _STATE.installed,
        "megatron_bridge": installed_version(),
        "replaced": {name: list(modules) for name, modules in _STATE.replaced.items()},
        "left_to_bridge": dict(_STATE.left_to_bridge),
    }
