"""Weights declare logical axes; sharding them over a 4-device mesh (fake CPU devices, in a
subprocess so the flag takes effect before JAX starts) leaves the logits unchanged."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding
    from pddjax.model.config import TINY
    from pddjax.model.dense import forward_full
    from pddjax.model import weights as wm
    assert len(jax.devices()) == 4
    cfg = TINY.replace(num_heads=4, num_kv_heads=2)
    w = wm.cast(wm.init_random(cfg, 0), jnp.float32)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    specs = wm.partition_specs(w, {"q_heads": "model", "kv_heads": "model", "ffn": "model", "vocab": "model"})
    sharded = jax.tree_util.tree_map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), w, specs)
    assert sharded.layers.w_up.sharding.spec[-1] == "model"
    tokens = jnp.asarray([[5, 9, 300, 4, 77, 8, 1, 2]], jnp.int32)
    ref = np.asarray(jax.jit(forward_full, static_argnums=1)(w, cfg, tokens))
    got = np.asarray(jax.jit(forward_full, static_argnums=1)(sharded, cfg, tokens))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    print("ok")
""")


def test_tensor_parallel_sharding_keeps_logits():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]
