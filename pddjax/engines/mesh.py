"""An engine's device mesh: tensor parallelism over N local devices on one axis, "model".

What is split (`EngineMesh.rules`, logical axes of `pddjax.model.weights.LOGICAL_AXES`):
  q_heads  always (wq, wo, q biases): attention runs on each device's heads;
  kv_heads when the KV heads divide by N (wk, wv, k/v biases and the KV pool's axis 1);
  ffn      when it divides by N (w_gate, w_up, w_down): the MLP's partial sums are all-reduced;
  vocab    when it divides by N (embed, lm_head): logits are gathered before sampling.
Otherwise an axis is replicated. The KV pool k, v [L, K, P, S, D] is split on K
(`PartitionSpec(None, "model")`) when K % N == 0; when N is a multiple of K (fewer KV heads
than devices) it is *replicated*: every device computes and holds all K heads and reads the
one its query heads share (kv head `shard * K // N`). Other degrees are refused
(`engine_config.degree_problem`). Sampling runs on replicated logits, so every device draws
the same token.

At degree 1 there is no mesh (`mesh` None): the single-device path, its executables and
their persistent-cache entries are exactly what they were before tensor parallelism.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pddjax.engines.engine_config import degree_problem
from pddjax.model import weights as wmod
from pddjax.model.config import ModelConfig

AXIS = "model"


@dataclasses.dataclass(frozen=True)
class EngineMesh:
    degree: int
    mesh: Mesh | None  # None at degree 1
    num_heads: int
    num_kv_heads: int
    kv_sharded: bool  # KV pool and k/v projections split over KV heads (else replicated)
    ffn_sharded: bool
    vocab_sharded: bool

    @classmethod
    def build(cls, cfg: ModelConfig, degree: int = 1) -> EngineMesh:
        """The mesh for `degree` devices; ValueError (one sentence) if the model does not admit
        it or this process has fewer devices."""
        problem = degree_problem(degree, cfg.num_heads, cfg.num_kv_heads)
        if problem:
            raise ValueError(f"model {cfg.name}: {problem}")
        mesh = None
        if degree > 1 and jax.process_count() > 1:  # a multi-host instance (engines/multihost.py): all its devices
            devices = jax.devices()
            if len(devices) != degree:
                raise ValueError(f"tensor_parallel = {degree} must equal the {len(devices)} devices of this "
                                 f"instance's {jax.process_count()} processes")
            mesh = Mesh(np.array(devices), (AXIS,))
        elif degree > 1:
            devices = jax.local_devices()
            if len(devices) < degree:
                raise ValueError(f"tensor_parallel = {degree} needs {degree} devices, but this process has "
                                 f"{len(devices)} ({devices[0].platform})")
            mesh = Mesh(np.array(devices[:degree]), (AXIS,))
        return cls(degree, mesh, cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads % degree == 0,
                   cfg.ffn_hidden % degree == 0, cfg.vocab_size % degree == 0)

    @property
    def rules(self) -> dict[str, str | None]:
        """Logical axis -> mesh axis for the weights (`weights.partition_specs`)."""
        on = {"q_heads": True, "kv_heads": self.kv_sharded, "ffn": self.ffn_sharded, "vocab": self.vocab_sharded}
        return {axis: AXIS if split else None for axis, split in on.items()}

    @property
    def pool_spec(self) -> PartitionSpec:
        """The KV pool's k, v [L, K, P, S, D]: axis 1 (KV heads) split, or replicated."""
        return PartitionSpec(None, AXIS) if self.kv_sharded and self.degree > 1 else PartitionSpec()

    def _named(self, spec: PartitionSpec) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, spec)

    @property
    def pool_sharding(self) -> NamedSharding | None:
        return self._named(self.pool_spec)

    @property
    def replicated(self) -> NamedSharding | None:
        return self._named(PartitionSpec())

    @property
    def heads_spec(self) -> PartitionSpec:
        """Per-token heads [T, H, D] split over the mesh (attention's q and output)."""
        return PartitionSpec(None, AXIS)

    def weight_shardings(self, w: wmod.Weights):
        """A Weights-shaped pytree of NamedSharding (None at degree 1)."""
        if self.mesh is None:
            return None
        specs = wmod.partition_specs(w, self.rules)
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))

    def kv_heads_of(self, shard: int) -> tuple[int, int]:
        """[start, stop) of the KV heads device `shard` holds (all of them when replicated)."""
        if not 0 <= shard < self.degree:
            raise ValueError(f"shard {shard} is outside this mesh of {self.degree} devices")
        if not self.kv_sharded:
            return 0, self.num_kv_heads
        per = self.num_kv_heads // self.degree
        return shard * per, (shard + 1) * per

    def kv_shards(self) -> list[tuple[int, int]]:
        """The distinct KV head ranges the pool is held in: one per device, or (0, K) once."""
        return sorted({self.kv_heads_of(i) for i in range(self.degree)})

    # ---- placing arrays ----------------------------------------------------------------
    def put_weights(self, w: wmod.Weights) -> wmod.Weights:
        return w if self.mesh is None else _put(w, self.weight_shardings(w))

    def put_pool(self, pool):
        """The pool (a KVPool) on its sharding; a no-op when it is there already."""
        if self.mesh is None or (pool.k.sharding == self.pool_sharding and pool.v.sharding == self.pool_sharding):
            return pool
        return _put(pool, self.pool_sharding)

    def put_replicated(self, tree):
        return tree if self.mesh is None else _put(tree, self.replicated)

    def describe(self) -> str:
        if self.degree == 1:
            return "1 device"
        kv = "KV heads split" if self.kv_sharded else f"KV replicated ({self.num_kv_heads} KV heads < {self.degree})"
        return f"tensor parallel over {self.degree} {self.mesh.devices.flat[0].platform} devices, {kv}"


def _put(tree, shardings):
    """jax.device_put, except on a mesh over several processes (engines/multihost.py): there each
    process places its own shards from its own copy (`make_array_from_callback`). device_put would
    first check that every process holds equal values, one collective per leaf (for the pool and
    the weights a gather of all of them); here they are equal by construction (the same weights
    and config everywhere, and the leader's op log gives every process the same step inputs)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    each = ([shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding)
            else treedef.flatten_up_to(shardings))
    placed = []
    for x, sharding in zip(leaves, each):
        host = np.asarray(x)
        placed.append(jax.make_array_from_callback(host.shape, sharding, lambda index, host=host: host[index]))
    return treedef.unflatten(placed)
