"""A tiny Megatron-core ``GPTModel`` that runs forward and backward on CPU (gloo), with CP attention: a CPU RNG
tracker, the rotary embedding in ``host_device_scope`` and ``verl_cppack``'s core attention."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
import torch.distributed as dist

from verl_cppack import ParallelContext
from verl_cppack.integrations.megatron import parallel_context_from_megatron
from verl_cppack.runtime.host_device import in_host_device_scope
from verl_cppack.runtime.megatron_engine import FUSIONS_OFF

Backend = Literal["gloo", "nccl"]
_TRACKER_NAME = "model-parallel-rng"


# ------------------------------------------------------------------------------------------ parallel state
def init_megatron_parallel(
    tp_size: int = 1, cp_size: int = 1, backend: Backend = "gloo", *, seed: int = 0
) -> ParallelContext:
    """Initialise ``megatron.core.parallel_state`` for TP x CP (DP = the rest) on the current process group -> the CP
    context (same sizes again: a no-op). ``gloo`` installs the CPU RNG tracker, ``nccl`` Megatron's CUDA one."""
    from megatron.core import parallel_state as mpu

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not dist.is_initialized():
        raise ValueError("init_megatron_parallel needs torch.distributed.init_process_group(...) to have run first")
    if dist.get_backend() != backend:
        raise ValueError(f"torch.distributed runs {dist.get_backend()!r} but backend={backend!r} was asked for")
    world = dist.get_world_size()
    if world % (tp_size * cp_size):
        raise ValueError(f"world size {world} is not divisible by tp_size * cp_size = {tp_size * cp_size}")
    if mpu.model_parallel_is_initialized():
        if (mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()) == (tp_size, cp_size):
            return parallel_context_from_megatron()
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp_size, context_parallel_size=cp_size)
    if backend == "gloo":
        install_cpu_rng_tracker(seed)
    else:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_context_from_megatron()


def install_cpu_rng_tracker(seed: int = 0) -> None:
    """Make ``tensor_parallel.get_cuda_rng_tracker()`` a tracker of CPU generator states (workaround 2)."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = CpuRNGStatesTracker()
    tracker.add(_TRACKER_NAME, seed + 2718)  # Megatron offsets the model-parallel seed the same way
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class CpuRNGStatesTracker:
    """The ``CudaRNGStatesTracker`` interface (add / fork / get_states / set_states) over the CPU generator."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} / seed {seed} already added")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was never added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


# ------------------------------------------------------------------------------------------------ model
def build_tiny_gpt(
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_query_groups: int | None = None,
    max_sequence_length: int = 256,
    attention: Literal["allgather", "ring"] = "allgather",
    seed: int = 0,
    use_te: bool = True,
) -> Any:
    """A small fp32 Megatron ``GPTModel`` (RoPE, optional GQA, no dropout) on the current parallel state; weights
    depend only on ``seed`` and the shapes (any CP size). CPU under gloo; under nccl GPU, TE unless ``use_te=False``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from verl_cppack.attention.core_attention import core_attention_class

    if not mpu.model_parallel_is_initialized():
        raise ValueError("call init_megatron_parallel(...) before build_tiny_gpt(...)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads})"
        )
    if num_query_groups is not None and num_attention_heads % num_query_groups:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of num_query_groups ({num_query_groups})"
        )
    on_cpu = not torch.cuda.is_available() or dist.get_backend() == "gloo"  # gloo runs are CPU runs
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        context_parallel_size=mpu.get_context_parallel_world_size(),
        use_cpu_initialization=on_cpu,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=torch.float32,
        **FUSIONS_OFF,
    )
    spec = get_gpt_layer_local_spec()
    core_attention = core_attention_class(attention, use_te=use_te and not on_cpu)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
    )
    rotary = getattr(model, "rotary_pos_emb", None)
    if on_cpu and rotary is not None:  # workaround 3: its move of inv_freq to torch.cuda.current_device() is the host's
        rotary.forward = in_host_device_scope(rotary.forward)
    return model
