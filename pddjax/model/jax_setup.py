"""Process-wide JAX settings: the persistent compilation cache (so a second start and the test
suite reuse compiled code), the platform choice, and, for tensor parallelism on a machine
without accelerators, fake CPU devices. Call `configure()` before the first jit."""

from __future__ import annotations

import os
import re

_done = False


def configure(platform: str | None = None, devices: int = 1) -> None:
    """Idempotent. `platform` ("cpu", "gpu", "tpu") pins JAX's backend when given.

    `devices` > 1 (an engine's `tensor_parallel`): the CPU backend gets that many fake host
    devices (`jax_num_cpu_devices`), so a tensor-parallel engine runs on a CPU-only machine: a
    test and development facility (the devices share the machine's cores). It works only
    before JAX starts its backends; later, or on GPU/TPU, the engine checks the devices it
    finds and names both numbers if they are too few. XLA_FLAGS'
    --xla_force_host_platform_device_count, if set, is left to decide."""
    global _done
    import jax

    if devices > 1:
        _request_cpu_devices(jax, devices)
    if _done:
        return
    from pddjax import env

    if platform:
        jax.config.update("jax_platforms", platform)
    jax.config.update("jax_compilation_cache_dir", env.jit_cache_dir())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _done = True


def _request_cpu_devices(jax, devices: int) -> None:
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if forced or jax.config.jax_num_cpu_devices >= devices:
        return
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # backends already started: the engine reports the shortfall
        pass
