"""Behaviour verification: a drop-in checks itself against verl's own function on its first real calls.

Signatures tell whether a drop-in can take verl's calls, not whether it gives verl's results. On a verl release
the release matrix does not test (``compare.TESTED_RELEASES``), and on any release with ``VERL_CPPACK_VERIFY=1``,
``patching`` installs each drop-in inside a ``VerifiedDropIn``. Its first call in each *mode* (the values of the
call's flag arguments: ``need_roll``, ``pre_process``, ``use_fp8_padding``, ``cp_layout``, which arguments are
``None``...) runs verl's function too — on copies of the arguments (verl's may rewrite them:
``postprocess_packed_seqs_for_dict_output`` rebinds ``output.entropy``), without autograd — and compares the two
results exactly (``compare.compare_call``), excusing only the intended differences of that release
(``compare.intended_keys``). The ranks of the CP group then decide together: one ``all_reduce(MIN)`` of the
verdict over megatron's CP group at that call (when torch.distributed is initialised and CP > 1), so no rank keeps
ours while another goes back to verl's:

- **equal** on every rank: the mode is verified; the drop-in's result is returned. Once every mode seen is
  verified and ``STEP_ASIDE_AFTER`` calls in a row needed no check, the plain drop-in replaces the wrapper in
  every module (no cost from then on);
- **different** on any rank (or ours raised where verl did not): verl's function is put back for the rest of the
  process in every module that bound it (``on_put_back``), one ``BehaviourChanged`` warning names the function,
  the release and the first difference, ``status()["put_back"]`` and ``verl-cppack doctor`` list it, and verl's
  result is returned;
- **verl raised** (a crash the drop-in fixes) on some rank and nothing differs: the drop-in's result is returned
  and the mode is checked again on its next call, at most ``MAX_TRIES`` times; after that the mode is taken as
  verified and ``status()`` says verl never ran it. Both raising is bad input: ours is raised, nothing is decided.

A call with an integer attention mask (``integer-masks``: verl indexes with it) is not compared.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from verl_cppack.integrations.verl import compare

VERIFY_ENV = "VERL_CPPACK_VERIFY"
MAX_TRIES = 8  # checks of one mode where verl's function raised, before the mode counts as verified
STEP_ASIDE_AFTER = 8  # calls in a row that needed no check, before the plain drop-in replaces the wrapper

# verdict codes, ordered so that the MIN over the CP group is the group's verdict
DIFFERENT, UNDECIDED, EQUAL = 0, 1, 2


class BehaviourChanged(UserWarning):
    """verl's function gives other results than its drop-in: verl's was put back."""


def requested() -> bool | None:
    """``VERL_CPPACK_VERIFY``: True (1/true/yes/on), False (0/false/no/off) or None (unset: by release)."""
    value = os.environ.get(VERIFY_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def wanted(release: str | None) -> bool:
    """Whether the drop-ins verify themselves: as ``VERL_CPPACK_VERIFY`` says, else when ``release`` is not one
    the release matrix tests."""
    asked = requested()
    return asked if asked is not None else release not in compare.TESTED_RELEASES


# ------------------------------------------------------------------------------------------------ helpers
def mode_of(bound: inspect.BoundArguments) -> tuple:
    """What tells one kind of call from another: bools and strings by value, everything else by kind."""
    mode = []
    for name, value in bound.arguments.items():
        if isinstance(value, (bool, str)) or value is None:
            mode.append((name, value))
        elif isinstance(value, torch.Tensor):
            mode.append((name, "nested" if value.is_nested else f"tensor{value.dim()}"))
        else:
            mode.append((name, type(value).__name__))
    return tuple(mode)


def copy_argument(value: Any) -> Any:
    """A copy verl's function may rewrite: tensors cloned (no autograd), containers and dataclass-like objects
    copied with their tensor attributes cloned; anything else (groups, numbers) shared."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(copy_argument(item) for item in value)
    if isinstance(value, dict) and type(value) is dict:
        return {key: copy_argument(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        duplicate = copy.copy(value)
        for name, item in vars(value).items():
            if isinstance(item, torch.Tensor):
                object.__setattr__(duplicate, name, item.detach().clone())
        if isinstance(value, dict):  # transformers' ModelOutput: a dataclass that is also a dict
            for key, item in value.items():
                if isinstance(item, torch.Tensor):
                    dict.__setitem__(duplicate, key, getattr(duplicate, key, item))
        return duplicate
    return value


def decide_together(verdict: int, device: torch.device) -> int:
    """The CP group's verdict: the MIN of every rank's (one all-reduce when torch.distributed is initialised and
    megatron's CP size is above 1; this rank's verdict otherwise)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return verdict
    from verl_cppack.integrations.megatron import parallel_context_from_megatron

    try:
        ctx = parallel_context_from_megatron()
    except (ImportError, ValueError):  # no megatron parallel state: no CP group to agree with
        return verdict
    if ctx.cp_size <= 1:
        return verdict
    group = ctx.cp_group
    if torch.distributed.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([verdict], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(flag.item())


def _device_of(bound: inspect.BoundArguments) -> torch.device:
    for value in bound.arguments.values():
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _raised(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:200]}"


# ------------------------------------------------------------------------------------------------ the wrapper
class VerifiedDropIn:
    """``dropin`` standing in for verl's ``original`` under ``name``, checking itself on its first calls.

    ``on_put_back(name, reason)``: put verl's function back wherever the wrapper is bound (called once, on a
    difference); ``on_step_aside(name, dropin)``: bind the plain drop-in instead of the wrapper (once, when
    every mode seen is verified). The wrapper stays callable either way (references kept elsewhere)."""

    def __init__(
        self,
        name: str,
        original: Callable[..., Any],
        dropin: Callable[..., Any],
        release: str | None,
        on_put_back: Callable[[str, str], None] | None = None,
        on_step_aside: Callable[[str, Callable[..., Any]], None] | None = None,
    ) -> None:
        self.name = name
        self.original = original
        self.dropin = dropin
        self.release = release
        self.excused = compare.intended_keys(release)
        self.signature = inspect.signature(original)
        self.on_put_back = on_put_back
        self.on_step_aside = on_step_aside
        self.verified: set[tuple] = set()
        self.tries: dict[tuple, int] = {}
        self.unverified: dict[tuple, str] = {}  # mode -> why it counts as verified without a comparison
        self.put_back_reason: str | None = None
        self.stepped_aside = False
        self.checks = 0  # calls that ran a comparison
        self.quiet_calls = 0  # calls in a row that needed none
        self._lock = threading.RLock()
        self.function = self._make_function()

    def _make_function(self) -> Callable[..., Any]:
        @functools.wraps(self.dropin)
        def verified(*args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)

        verified.__verl_cppack_verification__ = self  # type: ignore[attr-defined]
        return verified

    # -------------------------------------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        return {
            "release": self.release,
            "verified_modes": len(self.verified),
            "checks": self.checks,
            "put_back": self.put_back_reason,
            "stepped_aside": self.stepped_aside,
            "unverified": sorted(self.unverified.values()),
        }

    # -------------------------------------------------------------------------------------------- calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.put_back_reason is not None:
            return self.original(*args, **kwargs)
        if self.stepped_aside:
            return self.dropin(*args, **kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return self.dropin(*args, **kwargs)  # a call verl's function refuses: ours says why
        mode = mode_of(bound)
        with self._lock:
            if mode in self.verified:
                result = self.dropin(*args, **kwargs)
                self._quiet_call()
                return result
            return self._check(mode, args, kwargs, bound)

    def _quiet_call(self) -> None:
        self.quiet_calls += 1
        if self.quiet_calls >= STEP_ASIDE_AFTER and not self.stepped_aside:
            self.stepped_aside = True
            if self.on_step_aside is not None:
                self.on_step_aside(self.name, self.dropin)

    def _check(self, mode: tuple, args: tuple, kwargs: dict, bound: inspect.BoundArguments) -> Any:
        self.checks += 1
        self.quiet_calls = 0
        device = _device_of(bound)
        if compare.integer_mask(self.name, bound):
            decide_together(UNDECIDED, device)  # the other ranks check this call: answer them
            return self.dropin(*args, **kwargs)
        theirs: Any = None
        verl_error: BaseException | None = None
        copies = self.signature.bind(*copy_argument(bound.args), **copy_argument(bound.kwargs))
        try:
            with torch.no_grad():
                theirs = self.original(*copies.args, **copies.kwargs)
        except Exception as error:  # noqa: BLE001 - verl's failures are part of the verdict
            verl_error = error
        ours: Any = None
        our_error: BaseException | None = None
        try:
            ours = self.dropin(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - ours too
            our_error = error
        difference = None
        if verl_error is None and our_error is not None:
            difference = f"ours raised where verl's did not ({_raised(our_error)})"
        elif verl_error is None:
            try:
                findings = compare.compare_call(self.name, self.original, copies, theirs, ours)
            except Exception as error:  # noqa: BLE001 - results that cannot be compared are not known equal
                findings = [compare.Finding(self.name, "", "comparison-raised", _raised(error))]
            unexcused = [
                f for f in findings if compare.difference_key(self.name, f.where, _cp_size()) not in self.excused
            ]
            if unexcused:
                difference = unexcused[0].describe()
        verdict = DIFFERENT if difference else (UNDECIDED if verl_error is not None else EQUAL)
        verdict = decide_together(verdict, device)
        if verdict == DIFFERENT:
            self._put_back(difference or "another rank of the CP group found a difference")
            if verl_error is None:
                return theirs
        elif verdict == EQUAL:
            self.verified.add(mode)
        elif verl_error is not None and our_error is None:
            self.tries[mode] = self.tries.get(mode, 0) + 1
            if self.tries[mode] >= MAX_TRIES:
                self.verified.add(mode)
                self.unverified[mode] = f"verl's function raised on each of its first {MAX_TRIES} checks"
        elif verl_error is None:  # another rank's verl raised: check this mode again next call
            pass
        if our_error is not None:
            raise our_error
        return ours

    def _put_back(self, reason: str) -> None:
        self.put_back_reason = reason
        release = f"verl {self.release}" if self.release else "this verl"
        warnings.warn(
            f"verl_cppack: {release}'s {self.name} gives other results than its drop-in ({reason}); verl's own "
            f"{self.name} is put back for the rest of this process",
            BehaviourChanged,
            stacklevel=4,
        )
        if self.on_put_back is not None:
            self.on_put_back(self.name, reason)


def _cp_size() -> int:
    from verl_cppack.integrations.megatron import parallel_context_from_megatron

    try:
        return parallel_context_from_megatron().cp_size
    except (ImportError, ValueError):
        return 1


def verification_of(function: Callable[..., Any]) -> VerifiedDropIn | None:
    """The ``VerifiedDropIn`` behind a function ``patching`` bound, if it is one."""
    return getattr(function, "__verl_cppack_verification__", None)
