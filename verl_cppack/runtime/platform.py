"""A ``cpu`` platform for verl's ``PlatformRegistry`` (verl >= 0.9): the host is the device.

verl reaches the accelerator through ``get_platform()``: the device name ('cpu'), a ``torch.<device>``-like
module, the collective backend ('gloo') and the Ray resource. ``torch.cpu`` lacks what verl calls on it
(memory statistics, ``empty_cache``, RNG state, ``mem_get_info``...), so the device module is ``torch.cpu``
plus stand-ins that do what those calls mean on the host: nothing to free, no device memory, the CPU
generator's state.

The Ray resource stays ``"GPU"``: verl's resource pools count GPUs (or NPUs) only, so a CPU run starts Ray with
``num_gpus=<world size>`` logical GPUs, one per training worker, which the workers claim as usual.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

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

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: HOST_DEVICE_MODULE)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # never auto-detected: a CPU run is asked for with VERL_PLATFORM=cpu

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # Ray sets it for its logical GPUs; nothing reads it on the host

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU
