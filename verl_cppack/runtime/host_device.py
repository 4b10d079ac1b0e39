"""``host_device_scope()``: inside it, tensors that Megatron code asks to create on 'cuda' are created on the host;
the fixes wrap the entry points reaching Megatron's CUDA literals in it (rows 4, 7 and 12 of docs/design.md's table)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_DEPTH = 0  # process-wide: torch.cuda.current_device is process-wide too


def _is_cuda(device: Any) -> bool:
    """A device argument that means CUDA: 'cuda', 'cuda:N', torch.device('cuda'), or a bare index (cuda:N)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class _HostDeviceMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_device_scope() -> Iterator[None]:
    """Run the enclosed Megatron code with CUDA device literals meaning the host (re-entrant; the mode is per
    thread, the ``torch.cuda`` stand-ins are process-wide and counted under a lock)."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            for name, stand_in in _HOST_STAND_INS.items():
                _ORIGINAL[name] = getattr(torch.cuda, name)
                setattr(torch.cuda, name, stand_in)
        _DEPTH += 1
    try:
        with _HostDeviceMode():
            yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                for name in _HOST_STAND_INS:
                    setattr(torch.cuda, name, _ORIGINAL.pop(name))


_ORIGINAL: dict[str, Any] = {}
# torch.cuda calls the host answers in the scope (they raise without CUDA): streams for megatron-core 0.17+'s DDP grad
# sync (current stream) and Megatron-Bridge's DDP wrapping (a stream of its own; waits are no-ops on the host's)
_HOST_STAND_INS: dict[str, Callable[..., Any]] = {
    "current_device": lambda: "cpu",
    "current_stream": torch.cpu.current_stream,
    "Stream": torch.cpu.Stream,
    "stream": torch.cpu.stream,
}


def in_host_device_scope(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` wrapped so that every call runs inside ``host_device_scope()``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with host_device_scope():
            return function(*args, **kwargs)

    wrapper.__verl_cppack_host_scope__ = True
    return wrapper
