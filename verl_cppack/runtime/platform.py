"""A ``cpu`` platform for verl's ``PlatformRegistry`` (verl >= 0.9): the host is the device (``torch.cpu`` plus
stand-ins for what verl calls on it). The Ray resource stays ``"GPU"``: one logical GPU per training worker."""

from __future__ import annotations

import contextlib
import types

import torch

PLATFORM_NAME = "cpu"


def _host_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the calls verl makes on its device module, as the host understands them."""
    module = types.ModuleType("verl_cppack_host_device")
    module.__dict__.update({name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")})
    zero = lambda *args, **kwargs: 0  # noqa: E731 - no device memory is allocated, reserved or cached
    nothing = lambda *args, **kwargs: None  # noqa: E731 - nothing to free, collect or configure
    module.__dict__.update(
        is_available=lambda: True,
        current_device=lambda: "cpu",  # an int would mean cuda:N to torch
        device_count=lambda: 1,
        set_device=nothing,
        synchronize=nothing,
        empty_cache=nothing,
        ipc_collect=nothing,
        reset_peak_memory_stats=nothing,
        set_per_process_memory_fraction=nothing,
        memory_allocated=zero,
        max_memory_allocated=zero,
        memory_reserved=zero,
        max_memory_reserved=zero,
        mem_get_info=lambda *args, **kwargs: (0, 0),
        get_device_name=lambda *args, **kwargs: "cpu",
        get_rng_state=lambda *args, **kwargs: torch.get_rng_state(),
        set_rng_state=lambda state, *args, **kwargs: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )
    return module


HOST_DEVICE_MODULE = _host_device_module()


def cpu_platform_class() -> type:
    """The ``PlatformBase`` subclass (built lazily: verl is imported only once the platform is asked for)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """The host as verl's device: gloo collectives, no IPC, profiling and allocator settings are no-ops."""

        device_name = vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: HOST_DEVICE_MODULE)
        is_available = lambda self: True
        is_platform_available = lambda self, use_smi_check=False: False  # never auto-detected: VERL_PLATFORM=cpu
        current_device = lambda self: "cpu"
        device_count = lambda self: 1
        set_device = synchronize = set_allocator_settings = empty_cache = lambda self, *args: None
        profiler_start = profiler_stop = lambda self: None
        get_device_capability = lambda self, device_index=0: (None, None)
        communication_backend_name = lambda self: "gloo"
        visible_devices_envvar = lambda self: "CUDA_VISIBLE_DEVICES"  # Ray sets it for its logical GPUs; unread here
        ray_resource_name = lambda self: "GPU"
        ray_noset_envvars = lambda self: []
        is_ipc_supported = lambda self: False
        cudart = lambda self: None
        nvtx_range = contextlib.contextmanager(lambda self, msg: iter([None]))
        manual_seed = manual_seed_all = lambda self, seed: torch.manual_seed(seed)

    return PlatformCPU
