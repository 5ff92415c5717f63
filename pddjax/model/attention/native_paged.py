"""Paged attention as a native XLA:CPU kernel: native/paged_attention.cc, an XLA FFI custom call
(built with native/gemm.cc, the product of a step's rows and a stacked weight laid out in panels,
read in place, that `layers.InPlace` uses).

XLA has no paged attention op, so its CPU path (xla_paged.py) copies each row's pages into a
gathered block per layer, at the few GB/s XLA:CPU gathers 12 KB pages, before two batched
products. The native kernel reads the pages where they lie in the pool, page by page, with a
running softmax, over XLA's intra-op threads: the same math, one read of the KV.

The kernel is compiled on first use with the machine's C++ compiler (`CXX`, else g++) against
jaxlib's FFI headers, into `<cache>/native/<key>/` (key: the sources, jaxlib's version, the
compiler and the CPU's flags), written to a temporary name and renamed into place; later
processes load it. `available()` says whether it built; the attention's `auto` picks it on
CPU when it did, and falls back to XLA's with the reason logged once when it did not.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pddjax import env
from pddjax.model.attention.ragged import Ragged

log = logging.getLogger(__name__)

TARGET = "pddjax_paged_attention"
GEMM_TARGET = "pddjax_gemm"  # a step's rows times a stacked weight in panels, in place (native/gemm.cc; layers.InPlace)
_NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
SOURCES = tuple(os.path.join(_NATIVE, f) for f in ("paged_attention.cc", "gemm.cc"))
# included by the sources: in the library's key too
HEADERS = tuple(os.path.join(_NATIVE, f) for f in ("parallel.h", "counts.h"))
DTYPES = (jnp.float32, jnp.bfloat16)  # q and the pool; another dtype takes XLA's path


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> str:
    """The CPU's feature flags (the library is built for this CPU: -march=native)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _command(cxx: str, out: str, sources: tuple[str, ...] = SOURCES) -> list[str]:
    """The compiler's command line that builds `sources` into the shared library `out`."""
    return [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
            "-I", jax.ffi.include_dir(), *sources, "-o", out]


def _library_path(cxx: str) -> str:
    source = b""
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            source += f.read()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(repr((source, jax.lib.__version__, version, _cpu_flags(), platform.machine())).encode())
    return os.path.join(env.cache_dir(), "native", key.hexdigest()[:24], "libpddjax_attention.so")


def _build(path: str, cxx: str) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(_command(cxx, tmp), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {', '.join(SOURCES)}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> str | None:
    """Builds (once per machine) and registers the kernel; None when it is ready, else why not."""
    if platform.system() != "Linux":
        return f"the native attention is built on Linux only (this is {platform.system()})"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler (set CXX or install g++)"
    try:
        path = _library_path(cxx)
        if not os.path.exists(path):
            _build(path, cxx)
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PddjaxPagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_TARGET, jax.ffi.pycapsule(lib.PddjaxGemm), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        return str(e)
    return None


def available() -> bool:
    """True once the kernel is built and registered with XLA:CPU (built on the first call)."""
    why = _load()
    if why is not None:
        _warn_once(why)
    return why is None


@functools.cache
def _warn_once(why: str) -> None:
    log.warning("native paged attention unavailable, XLA's is used instead: %s", why)


def problem(q: jax.Array, k_pages: jax.Array) -> str | None:
    """Why the kernel cannot run these operands (dtype), or None."""
    if q.dtype not in DTYPES or k_pages.dtype not in DTYPES:
        return f"the native attention takes float32 or bfloat16, not q {q.dtype} / KV {k_pages.dtype}"
    return None


def paged_attention_native(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, rows: Ragged,
                           layer: jax.Array | int | None = None) -> jax.Array:
    """q: [T, H, D]; k_pages, v_pages: [L, KH, P, S, D] read at `layer` in place (or [KH, P, S, D]
    with layer None) -> out [T, H, D] in q.dtype, padding tokens zeros. Call `available()` first."""
    why = _load()
    if why is not None:
        raise RuntimeError(f"native paged attention unavailable: {why}")
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())  # []
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k_pages, v_pages, layer, rows.cu_q_lens.astype(jnp.int32), rows.kv_lens.astype(jnp.int32),
                rows.page_tables.astype(jnp.int32), sm_scale=np.float32(rows.sm_scale))


def product_in_place(x: jax.Array, panels: jax.Array, layer: jax.Array | int, n: int) -> jax.Array:
    """x [M, K] float32 @ layer `layer` of a stacked weight in panels (panels [L, P, K, 16] float32,
    `weights.Panels`, read in place) -> [M, n] float32 (native/gemm.cc, any M)."""
    why = _load()
    if why is not None:
        raise RuntimeError(f"native kernels unavailable: {why}")
    layer = jnp.asarray(layer, jnp.int32).reshape(())  # []
    call = jax.ffi.ffi_call(GEMM_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x, panels, layer)
