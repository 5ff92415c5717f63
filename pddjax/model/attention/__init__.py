"""Attention over the paged KV pool: one entry point, three implementations, one signature
(q [T, H, D], k_pages, v_pages [KH, P, S, D] (page 0 is scratch), and the step's rows, a
`Ragged`: ragged.py says what they hold): "xla" (plain jnp, gathers each row's pages: the
reference), "pallas" (the GPU/TPU kernel; interpreted on CPU) and "native" (an XLA:CPU custom
call that reads the pages in place: native_paged.py).

Under a tensor-parallel mesh (`mesh`, one axis "model"; pddjax/engines/mesh.py) q and the
output are split over query heads. XLA's attention is left to GSPMD (the same program,
partitioned by the compiler from the operands' shardings). The Pallas kernel is opaque to the
partitioner, so it runs per shard under `shard_map`: each device's query heads against its
own KV heads (pool split over KV heads), or, with a replicated pool (fewer KV heads than
devices), against the one KV head they share, read in place (`kv_head`).
"""

from __future__ import annotations

import jax

from pddjax.model.attention.ragged import Ragged
from pddjax.model.attention.xla_paged import paged_attention_xla, write_kv

IMPLS = ("xla", "pallas", "native")


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    rows: Ragged,
    *,
    impl: str = "xla",
    layer: jax.Array | int | None = None,
    mesh=None,
    kv_sharded: bool = True,
) -> jax.Array:
    """[T, H, D] attention output in q.dtype; padding tokens give zeros.

    With `layer`, k_pages/v_pages are the whole pool [L, KH, P, S, D]: Pallas reads that
    layer's pages in place; XLA slices the layer out first. `mesh` (a jax Mesh with axis
    "model", or None) and `kv_sharded` (the pool's KV-head axis split over it, else replicated)
    say how the operands are laid out."""
    if mesh is not None and impl == "pallas":
        return _pallas_per_shard(q, k_pages, v_pages, rows, layer=layer, mesh=mesh, kv_sharded=kv_sharded)
    if impl == "native":
        from pddjax.model.attention import native_paged

        if mesh is None and native_paged.problem(q, k_pages) is None:
            return native_paged.paged_attention_native(q, k_pages, v_pages, rows, layer=layer)
        impl = "xla"  # the custom call is opaque to GSPMD, and takes float32 / bfloat16 only
    if layer is not None and impl == "xla":
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    if impl == "xla":
        return paged_attention_xla(q, k_pages, v_pages, rows)
    if impl == "pallas":
        from pddjax.model.attention.pallas_paged import paged_attention_pallas

        return paged_attention_pallas(q, k_pages, v_pages, rows, layer=layer)
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")


def _pallas_per_shard(q, k_pages, v_pages, rows: Ragged, *, layer, mesh, kv_sharded):
    """The Pallas kernel on each device's query heads under shard_map: q [T, H/N, D] per device,
    the pool split over KV heads ([.., K/N, ..] per device) or whole (replicated)."""
    from jax.sharding import PartitionSpec as P

    from pddjax.model.attention.pallas_paged import paged_attention_pallas

    axis = mesh.axis_names[0]
    degree = mesh.shape[axis]
    num_kv_heads = k_pages.shape[-4]
    pool_spec = P(*([None] * (k_pages.ndim - 4)), axis) if kv_sharded else P()
    layer = jax.numpy.asarray(0 if layer is None else layer, jax.numpy.int32)

    def shard(q, k_pages, v_pages, rows, layer):
        # q: [T, H/N, D]; k_pages, v_pages: this device's pool (split or whole); rows: whole
        kv_head = None if kv_sharded else jax.lax.axis_index(axis) * num_kv_heads // degree
        return paged_attention_pallas(q, k_pages, v_pages, rows, layer=layer if k_pages.ndim == 5 else None,
                                      kv_head=kv_head)

    heads = P(None, axis)
    return jax.shard_map(shard, mesh=mesh, in_specs=(heads, pool_spec, pool_spec, P(), P()),
                         out_specs=heads, check_vma=False)(q, k_pages, v_pages, rows, layer)


def default_impl(backend: str | None = None) -> str:
    """The native kernel on CPU where it builds, else XLA (interpret-mode Pallas is slow); Pallas on
    GPU/TPU."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return "pallas"
    from pddjax.model.attention import native_paged

    return "native" if native_paged.available() else "xla"


__all__ = ["IMPLS", "Ragged", "default_impl", "paged_attention", "write_kv"]
