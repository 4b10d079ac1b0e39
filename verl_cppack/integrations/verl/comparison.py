"""The comparison of a drop-in with verl's own function, and what it is held to: the tested releases, util's
functions that pack nothing, the intended differences per release (docs/design.md's table: ``intended_rows``).
``Comparison`` records differences as ``Finding``s keyed by ``difference_key``; real, padding and last tokens are
read from verl's function on marker inputs, never from ours."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl_cppack.integrations.megatron import FallbackPackedSeqParams

TESTED_RELEASES = ("0.6.1", "0.7.0", "0.7.1", "0.8.0", "0.9.0", "0.9.1")  # oldest first
# util's public functions that pack nothing (an Ascend hook that returns None): no drop-in, and no "unknown" either
NOT_PACKING = frozenset({"preprocess_for_mindspeed"})

# difference key -> releases it is intended for ("all", versions, "a–b" ranges with an en dash), in design.md's order
INTENDED_DIFFERENCES: dict[str, str] = {
    "roll-last-token": "0.7.0–0.9.1",
    "roll-padding": "0.7.0–0.9.1",
    "positions-padding": "0.7.1",
    "positions-back-chunk": "0.7.1",
    "positions-roll": "0.7.1–0.9.1",
    "nested-float32-cp": "0.6.1–0.9.0",
    "crash-short-cp": "0.6.1–0.7.1",
    "crash-extended-cp": "0.7.0–0.9.0",
    "crash-dtype-cp": "0.6.1",
    "crash-trailing-dims": "0.7.0–0.8.0",
    "bshd-cp": "0.7.0–0.7.1",
    "integer-masks": "all",
    "unaligned-stream": "0.9.0–0.9.1",
    "empty-batch": "all",
    "vlm-bad-sizes": "0.8.0–0.9.1",
    "dynamic-cp-getter": "0.8.0–0.9.1",
    "npu": "0.8.0–0.9.1",
}

PSP_FIELDS = tuple(field.name for field in dataclasses.fields(FallbackPackedSeqParams))  # megatron-core 0.16's
NESTED_THD_PRE = {"preprocess_thd_engine", "preprocess_thd_no_padding", "preprocess_packed_seqs_no_padding"}
NESTED_THD_POST = {"postprocess_thd_engine", "postprocess_thd_no_padding", "postprocess_packed_seqs_no_padding"}
NESTED_BSHD_PRE = {"preprocess_bshd_engine", "preprocess_bshd_no_padding"}
# functions whose (original_)attention_mask selects tokens: where verl indexes with integer masks (integer-masks)
MASKED = {"preprocess_packed_seqs", "postprocess_packed_seqs", "postprocess_packed_seqs_for_dict_output"}
MASKED |= {"preprocess_bshd", "postprocess_bshd", "remove_left_padding", "recover_left_padding"}


def releases_of(spec: str) -> tuple[str, ...]:
    """``"all"``, ``"0.7.1"``, ``"0.7.0–0.9.1"`` or a comma-separated list of those, over ``TESTED_RELEASES``."""
    if spec.strip() == "all":
        return TESTED_RELEASES
    chosen: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        first, _, last = part.partition("–")
        last = last or first
        if first not in TESTED_RELEASES or last not in TESTED_RELEASES:
            raise ValueError(f"release {part!r} is not one of the tested releases {TESTED_RELEASES}")
        chosen += TESTED_RELEASES[TESTED_RELEASES.index(first) : TESTED_RELEASES.index(last) + 1]
    return tuple(chosen)


def intended_keys(release: str | None) -> frozenset[str]:
    """The keys intended for ``release``; for an untested (or unknown) one, the newest tested release's."""
    if release not in TESTED_RELEASES:
        release = TESTED_RELEASES[-1]
    return frozenset(key for key, spec in INTENDED_DIFFERENCES.items() if release in releases_of(spec))


def intended_rows() -> list[str]:
    """The opening cells of docs/design.md's rows, one per intended difference, in order."""
    return [f"| `{key}` | {spec} |" for key, spec in INTENDED_DIFFERENCES.items()]


def difference_key(function: str, where: str, cp_size: int) -> str:
    """The key a finding is listed under (``unlisted:<where>`` for one no key covers)."""
    keys = {"verl-raised-trailing_dims": "crash-trailing-dims", "positions-real": "positions-back-chunk"}
    keys |= {key: key for key in ("roll-last-token", "roll-padding", "positions-padding", "positions-roll")}
    if cp_size > 1:
        keys |= {"verl-raised-dtype": "crash-dtype-cp", "verl-raised-option": "crash-extended-cp"}
        keys["verl-raised"] = "bshd-cp" if function.endswith("bshd_no_padding") else "crash-short-cp"
        if function in NESTED_THD_POST:
            keys["dtype"] = "nested-float32-cp"
    return keys.get(where, f"unlisted:{where}")


@dataclass(frozen=True)
class Finding:
    """One comparison that was not equal: ``function``, the ``case`` (options, tensor), ``where``, ``detail``."""

    function: str
    case: str
    where: str
    detail: str = ""

    def describe(self) -> str:
        text = f"{self.where} [{self.case}]" if self.case else self.where
        return f"{text}: {self.detail}" if self.detail else text


def unexcused(findings: list[Finding], release: str | None, cp_size: int) -> list[Finding]:
    """The findings whose key is not intended for ``release``."""
    excused = intended_keys(release)
    return [f for f in findings if difference_key(f.function, f.where, cp_size) not in excused]


def _short(x: torch.Tensor, limit: int = 8) -> str:
    flat = x.detach().reshape(-1)
    return f"{flat[:limit].tolist()}{'...' if flat.numel() > limit else ''}"


class Comparison:
    """The findings of one comparison, and how many results of each function were compared."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.compared: dict[str, int] = {}

    def count(self, function: str) -> None:
        self.compared[function] = self.compared.get(function, 0) + 1

    def add(self, function: str, case: str, where: str, detail: str = "") -> None:
        self.findings.append(Finding(function, case, where, detail))

    def tensors(
        self,
        function: str,
        case: str,
        theirs: Any,
        ours: Any,
        regions: Mapping[str, torch.Tensor] | None = None,
        prefix: str = "",
    ) -> None:
        """Type, dtype, shape, device and values compared; values per named region (bool masks) or ``values``."""

        def add(where: str, detail: str = "") -> None:
            self.add(function, case, where, detail)

        if isinstance(theirs, torch.Tensor) and theirs.is_nested:
            if not (isinstance(ours, torch.Tensor) and ours.is_nested):
                return add(f"{prefix}type", "verl nested, ours not")
            if theirs.dtype != ours.dtype:
                add(f"{prefix}dtype", f"verl {theirs.dtype}, ours {ours.dtype}")
            theirs_parts, ours_parts = theirs.unbind(), ours.unbind()
            if len(theirs_parts) != len(ours_parts):
                return add(f"{prefix}shape", f"verl {len(theirs_parts)} rows, ours {len(ours_parts)}")
            for index, (a, b) in enumerate(zip(theirs_parts, ours_parts)):
                if a.shape != b.shape or a.device != b.device or not torch.equal(a.to(b.dtype), b):
                    return add(f"{prefix}values", f"row {index}: verl {_short(a)}, ours {_short(b)}")
            return None
        if not isinstance(ours, torch.Tensor) or not isinstance(theirs, torch.Tensor):
            if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
                add(f"{prefix}type", f"verl {type(theirs).__name__}, ours {type(ours).__name__}")
            elif ours is not theirs and ours != theirs:
                add(f"{prefix}values", f"verl {theirs!r}, ours {ours!r}")
            return None
        if theirs.dtype != ours.dtype:
            add(f"{prefix}dtype", f"verl {theirs.dtype}, ours {ours.dtype}")
        if theirs.shape != ours.shape:
            return add(f"{prefix}shape", f"verl {tuple(theirs.shape)}, ours {tuple(ours.shape)}")
        if theirs.device != ours.device:
            return add(f"{prefix}device", f"verl {theirs.device}, ours {ours.device}")
        differs = theirs.to(ours.dtype) != ours
        if not differs.any():
            return None
        region_dims = next(iter(regions.values())).dim() if regions else 1
        while differs.dim() > region_dims:
            differs = differs.any(dim=-1)
        explained = torch.zeros_like(differs)
        for region, selected in (regions or {}).items():
            selected = selected.to(differs.device)
            if (differs & selected).any():
                add(region)
            explained |= selected
        if (differs & ~explained).any():
            add(f"{prefix}values", f"verl {_short(theirs)}, ours {_short(ours)}")
        return None

    def params(self, function: str, case: str, theirs: Any, ours: Any) -> None:
        """The ``PackedSeqParams`` fields either has, compared as tensors (``params.<field>:values``...)."""
        for name in PSP_FIELDS:
            if hasattr(theirs, name) or hasattr(ours, name):
                self.tensors(
                    function, case, getattr(theirs, name, None), getattr(ours, name, None), prefix=f"params.{name}:"
                )

    def results(self, function: str, case: str, theirs: Any, ours: Any, regions: Mapping[int, Any]) -> None:
        """Two results part by part: tuples by index (``regions``: per index), dicts by key, params by field."""
        if isinstance(theirs, dict) and isinstance(ours, dict):
            if sorted(theirs) != sorted(ours):
                return self.add(function, case, "keys", f"verl {sorted(theirs)}, ours {sorted(ours)}")
            for key in theirs:
                self.tensors(function, case, theirs[key], ours[key], prefix=f"{key}:")
            return None
        if not (isinstance(theirs, (tuple, list)) and isinstance(ours, (tuple, list))):
            return self.tensors(function, case, theirs, ours)
        if len(theirs) != len(ours):
            return self.add(function, case, "arity", f"verl returns {len(theirs)} values, ours {len(ours)}")
        for index, (a, b) in enumerate(zip(theirs, ours)):
            rule = regions.get(index)
            if any(hasattr(value, "cu_seqlens_q") and hasattr(value, "qkv_format") for value in (a, b)):
                self.params(function, case, a, b)
            elif rule == "positions-roll" and isinstance(a, torch.Tensor) and getattr(b, "shape", None) == a.shape:
                if not torch.equal(a.to(b.dtype), b):
                    self.add(function, case, "positions-roll")
            else:
                rule = rule if isinstance(rule, dict) else None
                self.tensors(function, case, a, b, regions=rule, prefix=f"result[{index}]:")
        return None


# ------------------------------------------------------------------------------------------------ markers
def ones_like_nested(nested: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    """Nested ``[B, j]`` long ones with ``nested``'s offsets (``last_only``: 1 at each last token, else 0)."""
    offsets = nested.offsets()
    marker = torch.full((nested.values().shape[0],), int(not last_only), dtype=torch.long, device=offsets.device)
    marker[offsets[1:][offsets.diff() > 0] - 1] = 1
    return torch.nested.nested_tensor_from_jagged(marker, offsets=offsets)


def last_token_marker(nested: torch.Tensor) -> torch.Tensor:
    return ones_like_nested(nested, last_only=True)


# ------------------------------------------------------------------------------------------------ one call
def _marker_call(verl: Callable, bound: inspect.BoundArguments, marker: torch.Tensor) -> Any:
    arguments = dict(bound.arguments, input_ids=marker)
    arguments.update(
        {flag: value for flag, value in (("need_roll", False), ("pre_process", True)) if flag in arguments}
    )
    return verl(**arguments)


def _regions(function: str, verl: Callable, bound: inspect.BoundArguments, theirs: Any) -> dict[int, Any]:
    """Per result index: the regions of intended differences of that part (read from verl's function on markers)."""
    arguments = bound.arguments
    input_ids = arguments.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested or arguments.get("pre_process") is False:
        return {}
    rolled = bool(arguments.get("need_roll", False))
    if function in NESTED_THD_PRE:
        real = _marker_call(verl, bound, ones_like_nested(input_ids))[0][0] == 1  # [T_local] real tokens
        regions: dict[int, Any] = {}
        if rolled:
            last = _marker_call(verl, bound, last_token_marker(input_ids))[0][0] == 1
            regions[0] = {"roll-last-token": last[None], "roll-padding": ~real[None]}
        if isinstance(theirs, tuple) and len(theirs) > 2:
            regions[2] = (
                "positions-roll" if rolled else {"positions-real": real[None], "positions-padding": ~real[None]}
            )
        return regions
    if function in NESTED_BSHD_PRE and rolled:
        marker = _marker_call(verl, bound, last_token_marker(input_ids))
        return {0: {"roll-last-token": marker[0] == 1, "roll-padding": ~marker[1].bool()}}
    return {}


def compare_call(function: str, verl: Callable, bound: inspect.BoundArguments, theirs: Any, ours: Any) -> list[Finding]:
    """Where ``ours`` differs from ``theirs`` (``verl`` on ``bound``), intended regions named (``verl`` on markers)."""
    c = Comparison()
    with torch.no_grad():
        regions = _regions(function, verl, bound, theirs)
    c.results(function, "", theirs, ours, regions)
    return c.findings


def integer_mask(function: str, bound: inspect.BoundArguments) -> bool:
    """Whether the call passes an integer mask to a function that indexes with it (``integer-masks``: no reference)."""
    return function in MASKED and any(
        isinstance(bound.arguments.get(name), torch.Tensor) and bound.arguments[name].dtype != torch.bool
        for name in ("attention_mask", "original_attention_mask")
    )
