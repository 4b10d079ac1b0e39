"""The fixes that let verl's own trainer (Megatron engine, Ray workers) run on the host, one named function each,
registered (``@fix``) for the versions it was written for; each docstring names its row of docs/design.md's table."""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from verl_cppack.runtime.checked_fix import (
    Fix,
    FixTargetChanged,
    expect_attribute,
    expect_parameters,
    expect_source,
    fix,
    mark,
    marked,
)
from verl_cppack.runtime.host_device import in_host_device_scope
from verl_cppack.runtime.vllm_fixes import VERL, VLLM_FIXES

MEGATRON = ("megatron-core", ">=0.16.1,<0.20")  # 0.16.1 (pinned stack) and 0.17-0.19 (current stack) read and run
MBRIDGE = ("mbridge", ">=0.15.1,<0.16")
MEGATRON_BRIDGE = ("megatron-bridge", ">=0.6.0,<0.7")  # read against 0.6.2
_FIXES: list[Fix] = []
_fix = functools.partial(fix, _FIXES)  # @_fix(name, what it fixes, (distribution, versions), module)


# ------------------------------------------------------------------------------------------------ verl
@_fix("cpu-platform", "no 'cpu' platform in verl's PlatformRegistry", VERL, "verl.plugin.platform.platform_manager")
def register_cpu_platform(module: ModuleType) -> None:
    """Row 1: verl ships no 'cpu' platform; register ours so that ``VERL_PLATFORM=cpu`` resolves to the host."""
    from verl_cppack.runtime.platform import PLATFORM_NAME, cpu_platform_class

    registry = expect_attribute(module, "PlatformRegistry", "cpu-platform")
    expect_parameters(registry.register, ("platform",), "cpu-platform")
    if registry.get(PLATFORM_NAME) is None:
        registry.register(platform=PLATFORM_NAME)(cpu_platform_class())


@_fix("gloo-process-group", "worker process group backend 'cpu:gloo,cpu:gloo'", VERL, "verl.utils.distributed")
@_fix("gloo-process-group-workers", "the same, where the training worker bound it", VERL, "verl.workers.engine_workers")
def gloo_process_group(module: ModuleType) -> None:
    """Row 2: the training worker asks for backend "cpu:gloo,cpu:gloo" (gloo twice); on the host use "gloo"."""
    original = expect_attribute(module, "initialize_global_process_group_ray", "gloo-process-group")
    if marked(original):
        return
    expect_parameters(original, ("timeout_second", "backend"), "gloo-process-group")
    expect_source(
        original, 'backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"', "gloo-process-group"
    )

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    module.initialize_global_process_group_ray = mark(initialize_global_process_group_ray)


@_fix("float32-engine-config", "McoreEngineConfig refuses float32", VERL, "verl.workers.config.engine")
def float32_engine_config(module: ModuleType) -> None:
    """Row 3: ``McoreEngineConfig`` admits bfloat16/float16 only; admit float32 (the optimizer then keeps fp32)."""
    config_class = expect_attribute(module, "McoreEngineConfig", "float32-engine-config")
    original = config_class.__post_init__
    if marked(original):
        return
    expect_source(original, 'assert self.dtype in ["bfloat16", "float16"]', "float32-engine-config")

    @functools.wraps(original)
    def __post_init__(self) -> None:  # noqa: N807 - replaces the dataclass's own
        asked = self.dtype
        if asked not in ("float32", "fp32"):
            return original(self)
        object.__setattr__(self, "dtype", "bfloat16")  # pass the check, then restore what was asked for
        try:
            original(self)
        finally:
            object.__setattr__(self, "dtype", asked)

    config_class.__post_init__ = mark(__post_init__)


@_fix(
    "megatron-engine-on-cpu",
    "engine registry, RNG tracker, offload helpers, CUDA literals",
    VERL,
    "verl.workers.engine.megatron.transformer_impl",
)
def megatron_engine_on_cpu(module: ModuleType) -> None:
    """Rows 8-10 and 12: the engines registered for 'cpu' too (10), a CPU RNG tracker (9), no-op (off)load helpers
    (8), and the engine methods that reach Megatron's ``device='cuda'`` literals in ``host_device_scope`` (12)."""
    name = "megatron-engine-on-cpu"
    # Every target is checked before anything changes, so a refusal leaves the module as it was.
    engine_class = expect_attribute(module, "MegatronEngine", name)
    engines = expect_attribute(expect_attribute(module, "EngineRegistry", name), "_engines", name)
    by_model_type = []
    for model_type in ("language_model", "value_model"):
        by_device = engines.get(model_type, {}).get("megatron")
        if not by_device or "cuda" not in by_device:
            raise FixTargetChanged(f"CPU fix {name!r}: no Megatron {model_type} engine registered for cuda")
        by_model_type.append(by_device)
    original_seed = expect_attribute(module, "set_random_seed", name)
    if not marked(original_seed):
        expect_parameters(original_seed, ("seed",), name)
        expect_source(original_seed, "model_parallel_cuda_manual_seed", name)
    offload_helpers = {}
    for helper, parameters in (
        ("load_megatron_model_to_gpu", ("models", "load_grad", "load_frozen_params")),
        ("offload_megatron_model_to_cpu", ("models",)),
        ("load_megatron_optimizer", ("optimizers",)),
        ("offload_megatron_optimizer", ("optimizers",)),
    ):
        original = expect_attribute(module, helper, name)
        if not marked(original):
            expect_parameters(original, parameters, name)
            offload_helpers[helper] = original
    scoped = (
        "_build_megatron_module",
        "_build_optimizer",
        "optimizer_zero_grad",
        "optimizer_step",
        "forward_backward_batch",
    )
    methods = {method: expect_attribute(engine_class, method, name) for method in scoped}

    for by_device in by_model_type:
        by_device.setdefault("cpu", by_device["cuda"])
    if not marked(original_seed):

        @functools.wraps(original_seed)
        def set_random_seed(seed):
            import random

            import numpy

            from verl_cppack.runtime.tiny_gpt import install_cpu_rng_tracker

            torch.manual_seed(seed)  # what verl's function seeds, less the CUDA tracker
            numpy.random.seed(seed)
            random.seed(seed)
            install_cpu_rng_tracker(seed)

        module.set_random_seed = mark(set_random_seed)
    for helper, original in offload_helpers.items():
        setattr(module, helper, mark(functools.wraps(original)(lambda *args, **kwargs: None)))
    for method_name, method in methods.items():
        if not getattr(method, "__verl_cppack_host_scope__", False):
            setattr(engine_class, method_name, in_host_device_scope(method))


# --------------------------------------------------------------------------------------------- megatron
@_fix("clip-grads-on-host", "gradient clipping asserts CUDA tensors", MEGATRON, "megatron.core.optimizer.clip_grads")
def clip_grads_on_host(module: ModuleType) -> None:
    """Row 11: ``clip_grad_by_total_norm_fp32`` asserts CUDA gradients; on the host the same scaling is one
    ``torch._foreach_mul_`` (a tensor ``total_norm``, megatron-core 0.17+: clamped to 1 and always applied, as there)."""
    original = expect_attribute(module, "clip_grad_by_total_norm_fp32", "clip-grads-on-host")
    if marked(original):
        return
    expect_parameters(original, ("parameters", "max_norm", "total_norm", "use_decoupled_grad"), "clip-grads-on-host")
    expect_source(original, "assert param.grad.type() == 'torch.cuda.FloatTensor'", "clip-grads-on-host")

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attribute = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
        not_fp32 = {str(g.dtype) for g in grads if g.dtype != torch.float32 and not use_decoupled_grad}
        if not_fp32:
            raise TypeError(f"gradients must be float32 to be clipped on the host, got {sorted(not_fp32)}")
        clip_coefficient = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coefficient, torch.Tensor):
            if grads:
                torch._foreach_mul_([g.detach() for g in grads], clip_coefficient.clamp_max(1.0))
        elif clip_coefficient < 1.0 and grads:
            torch._foreach_mul_([g.detach() for g in grads], clip_coefficient)

    mark(clip_grad_by_total_norm_fp32)
    module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    import sys

    optimizer_module = sys.modules.get("megatron.core.optimizer.optimizer")
    if optimizer_module is not None and getattr(optimizer_module, "clip_grad_by_total_norm_fp32", None) is original:
        optimizer_module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


# ---------------------------------------------------------------------------------------------- mbridge
@_fix("local-layer-spec", "Transformer Engine layer spec", MBRIDGE, "mbridge.core.llm_bridge")
def local_layer_spec(module: ModuleType) -> None:
    """Row 5: mbridge builds Transformer Engine layers; on the host use Megatron's local spec with
    verl_cppack's core attention (THD + context parallelism without TE)."""
    bridge_class = expect_attribute(module, "LLMBridge", "local-layer-spec")
    original = bridge_class._get_transformer_layer_spec
    if marked(original):
        return
    expect_parameters(original, ("self", "vp_stage"), "local-layer-spec")
    expect_source(original, "use_transformer_engine=True", "local-layer-spec")
    decoder_block_spec = expect_attribute(module, "get_gpt_decoder_block_spec", "local-layer-spec")

    @functools.wraps(original)
    def _get_transformer_layer_spec(self, vp_stage=None):
        from verl_cppack.attention.core_attention import core_attention_class

        if self.config.normalization != "RMSNorm":
            raise ValueError(f"mbridge supports RMSNorm models only, got {self.config.normalization!r}")
        block_spec = decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)
        core_attention = core_attention_class("allgather", use_te=False)
        for layer_spec in block_spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = core_attention
        return block_spec

    bridge_class._get_transformer_layer_spec = mark(_get_transformer_layer_spec)


LOCAL_TO_FUSED_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


@_fix("local-layernorm-names", "weight names of TE's fused layernorms", MBRIDGE, "mbridge.core.bridge")
def local_layernorm_names(module: ModuleType) -> None:
    """Row 6: the local spec keeps the layernorms TE fuses as modules of their own: map those names to the fused
    ones, which mbridge maps to Hugging Face's."""
    bridge_class = expect_attribute(module, "Bridge", "local-layernorm-names")
    original = bridge_class._weight_name_mapping_mcore_to_hf
    if marked(original):
        return
    expect_parameters(original, ("self", "mcore_weights_name"), "local-layernorm-names")

    @functools.wraps(original)
    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name):
        for local, fused in LOCAL_TO_FUSED_NAMES.items():
            if mcore_weights_name.endswith(local):
                mcore_weights_name = mcore_weights_name[: -len(local)] + fused
                break
        return original(self, mcore_weights_name)

    bridge_class._weight_name_mapping_mcore_to_hf = mark(_weight_name_mapping_mcore_to_hf)


class _ModelTypeWithoutEncoderAndDecoder:
    """megatron-core's ``ModelType`` plus ``encoder_and_decoder`` (gone in 0.17) as a value no model's type equals."""

    def __init__(self, model_type: type) -> None:
        self._model_type = model_type
        self.encoder_and_decoder = object()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model_type, name)


@_fix(
    "mbridge-model-type",
    "mbridge compares with ModelType.encoder_and_decoder, gone in megatron-core 0.17",
    MBRIDGE,
    "mbridge.core.util",
)
def model_type_without_encoder_decoder(module: ModuleType) -> None:
    """mbridge 0.15.1's ``get_model`` compares with ``ModelType.encoder_and_decoder``, which megatron-core 0.17 dropped
    (an AttributeError for every model): not a CUDA assumption, the one fix the old mbridge needs on the current stack."""
    name = "mbridge-model-type"
    model_type = expect_attribute(module, "ModelType", name)
    if isinstance(model_type, _ModelTypeWithoutEncoderAndDecoder):
        return
    expect_source(expect_attribute(module, "get_model", name), "model_type == ModelType.encoder_and_decoder", name)
    if hasattr(model_type, "encoder_and_decoder"):
        return  # megatron-core 0.16 still has it: nothing to do
    module.ModelType = _ModelTypeWithoutEncoderAndDecoder(model_type)


# ------------------------------------------------------------------------------------------- Megatron-Bridge
@_fix(
    "transformer-engine-stand-in",
    "Megatron-Bridge imports Transformer Engine at package import",
    MEGATRON_BRIDGE,
    "megatron.core",
    needs=MEGATRON_BRIDGE[0],
)
def transformer_engine_stand_in(module: ModuleType) -> None:
    """Row 21: once megatron-core has loaded (its own guards found no TE), ``megatron.bridge``'s package body runs
    inside ``transformer_engine_scope`` (``runtime/transformer_engine_stand_in.py``). Nothing where TE is installed."""
    import importlib.util

    from verl_cppack.integrations import around_import
    from verl_cppack.runtime.transformer_engine_stand_in import PACKAGE, transformer_engine_scope

    if importlib.util.find_spec(PACKAGE) is None:
        around_import("megatron.bridge", transformer_engine_scope)


@_fix(
    "bridge-local-layer-spec",
    "Transformer Engine layer spec of Megatron-Bridge's GPT providers",
    MEGATRON_BRIDGE,
    "megatron.bridge.models.gpt_provider",
    needs=MEGATRON_BRIDGE[0],
)
def bridge_local_layer_spec(module: ModuleType) -> None:
    """Row 22: Megatron-Bridge's GPT providers build TE's layer spec; on the host the provider's own
    ``local_layer_spec`` with verl_cppack's core attention, as row 5 does for mbridge."""
    name = "bridge-local-layer-spec"
    original = expect_attribute(module, "transformer_engine_layer_spec", name)
    if marked(original):
        return
    expect_parameters(original, ("config",), name)
    expect_source(original, "get_gpt_layer_with_transformer_engine_spec(", name)
    local_spec = expect_attribute(module, "local_layer_spec", name)
    expect_parameters(local_spec, ("config",), name)

    @functools.wraps(original)
    def transformer_engine_layer_spec(config):
        from verl_cppack.attention.core_attention import core_attention_class

        spec = local_spec(config)
        spec.submodules.self_attention.submodules.core_attention = core_attention_class("allgather", use_te=False)
        return spec

    module.transformer_engine_layer_spec = mark(transformer_engine_layer_spec)


HF_ROLLOUT_NAME = "hf"
HF_ROLLOUT_MODULE = "verl_cppack.runtime.rollout.verl_adapter"
HF_ROLLOUT_ADAPTER = f"{HF_ROLLOUT_MODULE}.HFServerAdapter"


def load_hf_replica() -> type:
    """The replica class verl's ``RolloutReplicaRegistry`` loads for ``rollout.name=hf`` (imported on demand)."""
    import importlib

    return importlib.import_module(HF_ROLLOUT_MODULE).HFReplica


@_fix("hf-rollout-adapter", "no CPU rollout in verl's rollout registry", VERL, "verl.workers.rollout.base")
def hf_rollout_adapter(module: ModuleType) -> None:
    """Row 13: register ('hf', 'async') -> the Hugging Face server adapter in verl's rollout registry, by name."""
    registry = expect_attribute(module, "_ROLLOUT_REGISTRY", "hf-rollout-adapter")
    if not isinstance(registry, dict) or not all(isinstance(key, tuple) and len(key) == 2 for key in registry):
        raise FixTargetChanged(
            "CPU fix 'hf-rollout-adapter': _ROLLOUT_REGISTRY is no longer a dict keyed by (name, mode)"
        )
    current = registry.setdefault((HF_ROLLOUT_NAME, "async"), HF_ROLLOUT_ADAPTER)
    if current != HF_ROLLOUT_ADAPTER:
        raise FixTargetChanged(
            f"CPU fix 'hf-rollout-adapter': rollout ('hf', 'async') is already registered to {current}"
        )


@_fix("hf-rollout-replica", "no CPU rollout replica in verl's replica registry", VERL, "verl.workers.rollout.replica")
def hf_rollout_replica(module: ModuleType) -> None:
    """Row 14: register the 'hf' replica with verl's ``RolloutReplicaRegistry`` (its loader imports it on demand)."""
    registry = expect_attribute(module, "RolloutReplicaRegistry", "hf-rollout-replica")
    expect_parameters(registry.register, ("name", "loader"), "hf-rollout-replica")
    registry.register(HF_ROLLOUT_NAME, load_hf_replica)


FIXES: tuple[Fix, ...] = (*_FIXES, *VLLM_FIXES)  # verl's vLLM rollout on vLLM's CPU build: vllm_fixes.py
