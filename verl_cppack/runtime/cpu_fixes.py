"""The fixes that let verl's own trainer (Megatron engine, Ray workers) run on the host, one named function each,
registered (``@fix``) for the versions it was written for; each docstring names its row of docs/design.md's table."""

from __future__ import annotations

import functools
import sys
from types import ModuleType
from typing import Any

import torch

from verl_cppack.runtime.checked_fix import (
    Fix,
    FixTargetChanged,
    checked,
    expect_attribute,
    expect_parameters,
    expect_source,
    fix,
    replaces,
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

    registry = expect_attribute(module, "PlatformRegistry")
    expect_parameters(registry.register, ("platform",))
    if registry.get(PLATFORM_NAME) is None:
        registry.register(platform=PLATFORM_NAME)(cpu_platform_class())


@_fix("gloo-process-group", "worker process group backend 'cpu:gloo,cpu:gloo'", VERL, "verl.utils.distributed")
@_fix("gloo-process-group-workers", "the same, where the training worker bound it", VERL, "verl.workers.engine_workers")
def gloo_process_group(module: ModuleType) -> None:
    """Row 2: the training worker asks for backend "cpu:gloo,cpu:gloo" (gloo twice); on the host use "gloo"."""
    line = 'backend = backend or f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"'
    original = checked(module, "initialize_global_process_group_ray", ("timeout_second", "backend"), line)
    if original is None:
        return

    @replaces(module, "initialize_global_process_group_ray", original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")


@_fix("float32-engine-config", "McoreEngineConfig refuses float32", VERL, "verl.workers.config.engine")
def float32_engine_config(module: ModuleType) -> None:
    """Row 3: ``McoreEngineConfig`` admits bfloat16/float16 only; admit float32 (the optimizer then keeps fp32)."""
    config_class = expect_attribute(module, "McoreEngineConfig")
    original = checked(config_class, "__post_init__", None, 'assert self.dtype in ["bfloat16", "float16"]')
    if original is None:
        return

    @replaces(config_class, "__post_init__", original)
    def __post_init__(self) -> None:  # noqa: N807 - replaces the dataclass's own
        asked = self.dtype
        if asked not in ("float32", "fp32"):
            return original(self)
        object.__setattr__(self, "dtype", "bfloat16")  # pass the check, then restore what was asked for
        try:
            original(self)
        finally:
            object.__setattr__(self, "dtype", asked)


@_fix(
    "megatron-engine-on-cpu",
    "engine registry, RNG tracker, offload helpers, CUDA literals",
    VERL,
    "verl.workers.engine.megatron.transformer_impl",
)
def megatron_engine_on_cpu(module: ModuleType) -> None:
    """Rows 8-10 and 12: the engines registered for 'cpu' too (10), a CPU RNG tracker (9), no-op (off)load helpers
    (8), and the engine methods that reach Megatron's ``device='cuda'`` literals in ``host_device_scope`` (12)."""
    # Every target is checked before anything changes, so a refusal leaves the module as it was.
    engine_class = expect_attribute(module, "MegatronEngine")
    engines = expect_attribute(expect_attribute(module, "EngineRegistry"), "_engines")
    by_model_type = []
    for model_type in ("language_model", "value_model"):
        by_device = engines.get(model_type, {}).get("megatron")
        if not by_device or "cuda" not in by_device:
            raise FixTargetChanged(f"no Megatron {model_type} engine registered for cuda")
        by_model_type.append(by_device)
    original_seed = checked(module, "set_random_seed", ("seed",), "model_parallel_cuda_manual_seed")
    offload_helpers = {
        helper: checked(module, helper, parameters)
        for helper, parameters in (
            ("load_megatron_model_to_gpu", ("models", "load_grad", "load_frozen_params")),
            ("offload_megatron_model_to_cpu", ("models",)),
            ("load_megatron_optimizer", ("optimizers",)),
            ("offload_megatron_optimizer", ("optimizers",)),
        )
    }
    scoped = ("_build_megatron_module", "_build_optimizer", "optimizer_zero_grad", "optimizer_step")
    methods = {method: expect_attribute(engine_class, method) for method in (*scoped, "forward_backward_batch")}

    for by_device in by_model_type:
        by_device.setdefault("cpu", by_device["cuda"])
    if original_seed is not None:

        @replaces(module, "set_random_seed", original_seed)
        def set_random_seed(seed):
            import random

            import numpy

            from verl_cppack.runtime.tiny_gpt import install_cpu_rng_tracker

            torch.manual_seed(seed)  # what verl's function seeds, less the CUDA tracker
            numpy.random.seed(seed)
            random.seed(seed)
            install_cpu_rng_tracker(seed)

    for helper, original in offload_helpers.items():
        if original is not None:
            replaces(module, helper, original)(lambda *args, **kwargs: None)
    for method_name, method in methods.items():
        if not getattr(method, "__verl_cppack_host_scope__", False):
            setattr(engine_class, method_name, in_host_device_scope(method))


# --------------------------------------------------------------------------------------------- megatron
@_fix("clip-grads-on-host", "gradient clipping asserts CUDA tensors", MEGATRON, "megatron.core.optimizer.clip_grads")
def clip_grads_on_host(module: ModuleType) -> None:
    """Row 11: ``clip_grad_by_total_norm_fp32`` asserts CUDA gradients; on the host the same scaling is one
    ``torch._foreach_mul_`` (a tensor ``total_norm``, megatron-core 0.17+: clamped to 1 and always applied, as there)."""
    parameters = ("parameters", "max_norm", "total_norm", "use_decoupled_grad")
    line = "assert param.grad.type() == 'torch.cuda.FloatTensor'"
    original = checked(module, "clip_grad_by_total_norm_fp32", parameters, line)
    if original is None:
        return

    @replaces(module, "clip_grad_by_total_norm_fp32", original)
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

    optimizer_module = sys.modules.get("megatron.core.optimizer.optimizer")
    if optimizer_module is not None and getattr(optimizer_module, "clip_grad_by_total_norm_fp32", None) is original:
        optimizer_module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


# ---------------------------------------------------------------------------------------------- mbridge
@_fix("local-layer-spec", "Transformer Engine layer spec", MBRIDGE, "mbridge.core.llm_bridge")
def local_layer_spec(module: ModuleType) -> None:
    """Row 5: on the host, Megatron's local layer spec with verl_cppack's core attention instead of mbridge's TE one."""
    bridge_class = expect_attribute(module, "LLMBridge")
    original = checked(bridge_class, "_get_transformer_layer_spec", ("self", "vp_stage"), "use_transformer_engine=True")
    if original is None:
        return
    decoder_block_spec = expect_attribute(module, "get_gpt_decoder_block_spec")

    @replaces(bridge_class, "_get_transformer_layer_spec", original)
    def _get_transformer_layer_spec(self, vp_stage=None):
        from verl_cppack.attention.core_attention import core_attention_class

        if self.config.normalization != "RMSNorm":
            raise ValueError(f"mbridge supports RMSNorm models only, got {self.config.normalization!r}")
        block_spec = decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)
        core_attention = core_attention_class("allgather", use_te=False)
        for layer_spec in block_spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = core_attention
        return block_spec


LOCAL_TO_FUSED_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


@_fix("local-layernorm-names", "weight names of TE's fused layernorms", MBRIDGE, "mbridge.core.bridge")
def local_layernorm_names(module: ModuleType) -> None:
    """Row 6: map the local spec's own layernorm names to the TE-fused ones, which mbridge maps to Hugging Face's."""
    bridge_class = expect_attribute(module, "Bridge")
    original = checked(bridge_class, "_weight_name_mapping_mcore_to_hf", ("self", "mcore_weights_name"))
    if original is None:
        return

    @replaces(bridge_class, "_weight_name_mapping_mcore_to_hf", original)
    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name):
        for local, fused in LOCAL_TO_FUSED_NAMES.items():
            if mcore_weights_name.endswith(local):
                mcore_weights_name = mcore_weights_name[: -len(local)] + fused
                break
        return original(self, mcore_weights_name)


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
    """mbridge 0.15.1's ``get_model`` reads ``ModelType.encoder_and_decoder``, gone in megatron-core 0.17: add it."""
    model_type = expect_attribute(module, "ModelType")
    if isinstance(model_type, _ModelTypeWithoutEncoderAndDecoder):
        return
    expect_source(expect_attribute(module, "get_model"), "model_type == ModelType.encoder_and_decoder")
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
    """Row 21: where TE is not installed, ``megatron.bridge``'s package body runs in ``transformer_engine_scope``."""
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
    """Row 22: Megatron-Bridge's GPT providers get their own ``local_layer_spec`` with our core attention (as row 5)."""
    original = checked(
        module, "transformer_engine_layer_spec", ("config",), "get_gpt_layer_with_transformer_engine_spec("
    )
    if original is None:
        return
    local_spec = checked(module, "local_layer_spec", ("config",))

    @replaces(module, "transformer_engine_layer_spec", original)
    def transformer_engine_layer_spec(config):
        from verl_cppack.attention.core_attention import core_attention_class

        spec = local_spec(config)
        spec.submodules.self_attention.submodules.core_attention = core_attention_class("allgather", use_te=False)
        return spec


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
    registry = expect_attribute(module, "_ROLLOUT_REGISTRY")
    if not isinstance(registry, dict) or not all(isinstance(key, tuple) and len(key) == 2 for key in registry):
        raise FixTargetChanged("_ROLLOUT_REGISTRY is no longer a dict keyed by (name, mode)")
    current = registry.setdefault((HF_ROLLOUT_NAME, "async"), HF_ROLLOUT_ADAPTER)
    if current != HF_ROLLOUT_ADAPTER:
        raise FixTargetChanged(f"rollout ('hf', 'async') is already registered to {current}")


@_fix("hf-rollout-replica", "no CPU rollout replica in verl's replica registry", VERL, "verl.workers.rollout.replica")
def hf_rollout_replica(module: ModuleType) -> None:
    """Row 14: register the 'hf' replica with verl's ``RolloutReplicaRegistry`` (its loader imports it on demand)."""
    registry = expect_attribute(module, "RolloutReplicaRegistry")
    expect_parameters(registry.register, ("name", "loader"))
    registry.register(HF_ROLLOUT_NAME, load_hf_replica)


FIXES: tuple[Fix, ...] = (*_FIXES, *VLLM_FIXES)  # verl's vLLM rollout on vLLM's CPU build: vllm_fixes.py
