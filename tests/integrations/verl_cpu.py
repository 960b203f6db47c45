"""A CPU platform for verl, so that verl's GPU-only tests run on CPU with gloo.

verl resolves its device once (`verl.plugin.platform.get_platform()`) and falls back to
CUDA when it finds no accelerator. `install()` registers this platform before anything
asks: device "cpu", collectives over gloo, the CPU RNG state as the device's, and one
"device" per rank of the job (verl's test asserts it has at least two). Nothing here
changes what the code under test does; it only answers verl's device questions.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed


def _device_module() -> types.SimpleNamespace:
    """What verl calls on `torch.<device>`, for CPU: every rank is its own device."""
    return types.SimpleNamespace(
        device_count=lambda: max(1, int(os.environ.get("WORLD_SIZE", "1"))),
        current_device=lambda: 0, set_device=lambda index: None, is_available=lambda: True,
        synchronize=lambda device=None: None, empty_cache=lambda: None,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state)


def install() -> None:
    """Make verl's platform the CPU one (call before verl resolves its platform)."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    module = _device_module()

    class CPUPlatform(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: module)

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return module.device_count()

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    platform_manager.set_platform(CPUPlatform())


def initialize_global_process_group(timeout_second: int = 36000) -> tuple[int, int, int]:
    """verl's `initialize_global_process_group` on CPU: gloo alone (verl's builds the
    backend string "cpu:gloo,<device>:<backend>", which is "cpu:gloo,cpu:gloo" here and
    refused by torch as a duplicate)."""
    from datetime import timedelta

    torch.distributed.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_second),
                                         init_method=os.environ.get("DIST_INIT_METHOD", None))
    return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
