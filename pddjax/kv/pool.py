"""Device-side paged KV pool: per layer, K and V pages.

Layout: k, v [L, K, P, S, D] (layers, kv heads, pages, page size, head dim): per layer it is
the [K, P, S, D] layout the attention kernels read (one kv head's pages are contiguous, which
keeps Triton/TPU blocks power-of-two sized). Page 0 is the scratch page: padding tokens write
there and page tables are padded with it. Page size and dtype are engine settings.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVPool:
    k: jax.Array  # [L, K, P, S, D]
    v: jax.Array  # [L, K, P, S, D]

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
              dtype) -> KVPool:
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self):
        return self.k.dtype

    def bytes_per_page(self) -> int:
        L, K, _, S, D = self.k.shape
        return 2 * L * K * S * D * jnp.dtype(self.k.dtype).itemsize


def write_tokens(pool: KVPool, k_new, v_new, slot_pages, slot_offsets) -> KVPool:
    """Scatter all layers' K/V of T tokens into their slots.

    k_new, v_new: [L, K, T, D]; slot_pages, slot_offsets: [T] int32 (padding -> page 0)."""
    k = pool.k.at[:, :, slot_pages, slot_offsets].set(k_new.astype(pool.k.dtype))
    v = pool.v.at[:, :, slot_pages, slot_offsets].set(v_new.astype(pool.v.dtype))
    return KVPool(k, v)


def read_tokens(pool: KVPool, slot_pages, slot_offsets):
    """Gather all layers' K/V of T token slots -> (k, v) [L, K, T, D]."""
    return pool.k[:, :, slot_pages, slot_offsets], pool.v[:, :, slot_pages, slot_offsets]
