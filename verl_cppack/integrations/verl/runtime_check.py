"""The runtime check: on an untested release (or ``VERL_CPPACK_VERIFY=1``) each drop-in is bound inside a
``VerifiedDropIn``, whose first call per *mode* (``mode_of``) also runs verl's function on copies and compares the
results exactly (``comparison.compare_call``, intended differences excused). The CP group decides by one
``all_reduce(MIN)``: equal verifies the mode; a difference on any rank, or ours raising alone, puts verl's function
back (one ``BehaviourChanged`` warning, verl's result returned); verl raising retries the mode, ``MAX_TRIES`` at most.
Integer masks are not compared."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from verl_cppack.integrations.megatron import parallel_context_from_megatron
from verl_cppack.integrations.verl import comparison

VERIFY_ENV = "VERL_CPPACK_VERIFY"
MAX_TRIES = 8  # checks of one mode where verl's function raised, before the mode counts as verified
STEP_ASIDE_AFTER = 8  # calls in a row that needed no check, before the plain drop-in replaces the wrapper
DIFFERENT, UNDECIDED, EQUAL = 0, 1, 2  # verdicts, ordered so that the MIN over the CP group is the group's


class BehaviourChanged(UserWarning):
    """verl's function gives other results than its drop-in: verl's was put back."""


def wanted(release: str | None) -> bool:
    """``VERL_CPPACK_VERIFY`` (1/true/yes/on or 0/false/no/off) when set, else whether ``release`` is untested."""
    value = os.environ.get(VERIFY_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value in ("1", "true", "yes", "on")
    return release not in comparison.TESTED_RELEASES


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
    """A copy verl's function may rewrite: tensors, and those in containers and dataclasses, cloned (no autograd);
    anything else (groups, numbers) shared."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (list, tuple):
        return type(value)(copy_argument(item) for item in value)
    if type(value) is dict:
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


def _cp_context() -> Any:
    """Megatron's parallel context, or None without megatron's parallel state."""
    try:
        return parallel_context_from_megatron()
    except (ImportError, ValueError):
        return None


def decide_together(verdict: int, device: torch.device) -> int:
    """The MIN of every CP rank's verdict (one all-reduce when torch.distributed is up and CP > 1)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return verdict
    ctx = _cp_context()
    if ctx is None or ctx.cp_size <= 1:
        return verdict
    if torch.distributed.get_backend(ctx.cp_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([verdict], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=ctx.cp_group)
    return int(flag.item())


def _raised(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:200]}"


class VerifiedDropIn:
    """``dropin`` standing in for verl's ``original``, checking itself on its first calls; the callbacks rebind."""

    def __init__(
        self,
        name: str,
        original: Callable[..., Any],
        dropin: Callable[..., Any],
        release: str | None,
        on_put_back: Callable[[str, str], None] | None = None,
        on_step_aside: Callable[[str, Callable[..., Any]], None] | None = None,
    ) -> None:
        self.name, self.original, self.dropin, self.release = name, original, dropin, release
        self.signature = inspect.signature(original)
        self.on_put_back, self.on_step_aside = on_put_back, on_step_aside
        self.verified: set[tuple] = set()
        self.tries: Counter[tuple] = Counter()
        self.unverified: dict[tuple, str] = {}  # mode -> why it counts as verified without a comparison
        self.put_back_reason: str | None = None
        self.stepped_aside = False
        self.checks = self.quiet_calls = 0  # calls that ran a comparison; calls in a row that needed none
        self._lock = threading.RLock()

        @functools.wraps(dropin)
        def verified(*args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)

        verified.__verl_cppack_verification__ = self  # type: ignore[attr-defined]
        self.function = verified

    def state(self) -> dict[str, Any]:
        return {
            "release": self.release,
            "verified_modes": len(self.verified),
            "checks": self.checks,
            "put_back": self.put_back_reason,
            "stepped_aside": self.stepped_aside,
            "unverified": sorted(self.unverified.values()),
        }

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
            if mode not in self.verified:
                return self._check(mode, args, kwargs, bound)
            result = self.dropin(*args, **kwargs)
            self.quiet_calls += 1
            if self.quiet_calls >= STEP_ASIDE_AFTER and not self.stepped_aside:
                self.stepped_aside = True
                if self.on_step_aside is not None:
                    self.on_step_aside(self.name, self.dropin)
            return result

    def _check(self, mode: tuple, args: tuple, kwargs: dict, bound: inspect.BoundArguments) -> Any:
        self.checks += 1
        self.quiet_calls = 0
        device = next((v.device for v in bound.arguments.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        if comparison.integer_mask(self.name, bound):
            decide_together(UNDECIDED, device)  # the other ranks check this call: answer them
            return self.dropin(*args, **kwargs)
        theirs = ours = verl_error = our_error = None
        copies = self.signature.bind(*copy_argument(bound.args), **copy_argument(bound.kwargs))
        try:
            with torch.no_grad():
                theirs = self.original(*copies.args, **copies.kwargs)
        except Exception as error:  # noqa: BLE001 - verl's failures are part of the verdict
            verl_error = error
        try:
            ours = self.dropin(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - ours too
            our_error = error
        difference = None
        if verl_error is None and our_error is not None:
            difference = f"ours raised where verl's did not ({_raised(our_error)})"
        elif verl_error is None:
            try:
                findings = comparison.compare_call(self.name, self.original, copies, theirs, ours)
            except Exception as error:  # noqa: BLE001 - results that cannot be compared are not known equal
                findings = [comparison.Finding(self.name, "", "comparison-raised", _raised(error))]
            ctx = _cp_context()
            left = comparison.unexcused(findings, self.release, ctx.cp_size if ctx is not None else 1)
            difference = left[0].describe() if left else None
        verdict = decide_together(DIFFERENT if difference else (UNDECIDED if verl_error is not None else EQUAL), device)
        if verdict == DIFFERENT:
            self.put_back_reason = reason = difference or "another rank of the CP group found a difference"
            release = f"verl {self.release}" if self.release else "this verl"
            warnings.warn(
                f"verl_cppack: {release}'s {self.name} gives other results than its drop-in ({reason}); verl's own "
                f"{self.name} is put back for the rest of this process",
                BehaviourChanged,
                stacklevel=3,
            )
            if self.on_put_back is not None:
                self.on_put_back(self.name, reason)
            if verl_error is None:
                return theirs
        elif verdict == EQUAL:
            self.verified.add(mode)
        elif verl_error is not None and our_error is None:
            self.tries[mode] += 1
            if self.tries[mode] >= MAX_TRIES:
                self.verified.add(mode)
                self.unverified[mode] = f"verl's function raised on each of its first {MAX_TRIES} checks"
        if our_error is not None:
            raise our_error
        return ours


def verification_of(function: Callable[..., Any]) -> VerifiedDropIn | None:
    """The ``VerifiedDropIn`` behind a function ``patching`` bound, if it is one."""
    return getattr(function, "__verl_cppack_verification__", None)
