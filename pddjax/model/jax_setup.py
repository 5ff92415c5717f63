"""Process-wide JAX settings: the persistent compilation cache (so a second start and the test
suite reuse compiled code) and the platform choice. Call `configure()` before the first jit."""

from __future__ import annotations

import os

_done = False


def configure(platform: str | None = None) -> None:
    """Idempotent. `platform` ("cpu", "gpu", "tpu") pins JAX's backend when given."""
    global _done
    if _done:
        return
    import jax

    from pddjax.model.fingerprint import cache_root

    if platform:
        jax.config.update("jax_platforms", platform)
    cache_dir = os.environ.get("PDDJAX_JIT_CACHE_DIR", os.path.join(cache_root(), "jit"))
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _done = True
