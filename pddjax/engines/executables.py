"""The paged step's compiled programs, held in one LRU: each `(program, argument signature,
statics)` key is its own XLA executable, a few MB of host memory.

The step is two programs (engines/step.py): the forward, one per step shape (T, B, MP, Q), and
the sampler, one per row count B. `Executables.build` returns the executable of a key, held or
compiled now: a single-device one from the executable cache on disk when it has it
(exec_cache.py: no tracing, no lowering), else traced, lowered and compiled afresh and stored
there; a sharded one traced, lowered and compiled with XLA's compile found in JAX's persistent
cache when it holds it. At most `capacity` are held, least recently used evicted first; an
evicted key comes back from disk, not from a fresh compile. Evicting an executable is not
enough to bound memory: JAX's own tracing and lowering caches keep every shape ever lowered
(~1-2 MB each here), so every `TRIM_EVERY` evictions `jax.clear_caches()` drops them (and every
jitted function's cache: the KV copies reload from disk on next use) and `malloc_trim` hands
the freed heap back (measured on the tiny model, 140 builds of ~60 distinct shapes at a cap of
8: RSS 440 -> 603 MB and rising without, flat ~290 with).
"""

from __future__ import annotations

import collections
import ctypes
import threading
import weakref

import jax

from pddjax import env
from pddjax.engines import exec_cache

TRIM_EVERY = 8  # evictions between clearing JAX's internal caches


class Executables:
    """LRU of compiled step programs keyed by program name, argument shapes, dtypes and
    shardings, and statics. Thread-safe (a service's engine thread, its background build and
    a test may share it). `built` counts programs compiled (or loaded from disk) in this process,
    `built_behind` those of a background build."""

    def __init__(self, capacity: int):
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.built = 0
        self.built_behind = 0
        self.evicted = 0
        self._weights: dict[int, tuple] = {}  # id(weights) -> (weak reference, signature)
        self.resize(capacity)

    def build(self, program: str, make, args: tuple, statics: dict, key_args: tuple | None = None,
              sharded: bool = False, behind: bool = False, options=None):
        """The executable of `make()` (-> an object with `.lower(*args, **statics)`: called only
        to build) for these arguments and statics: held, or built now. Nothing runs. `args[0]` of the "forward"
        program is the weights (their signature is computed once per weights object);
        `key_args`, when given, stands for `args` in the key (the sampler keys its logits by
        shape and dtype alone). `sharded`: a multi-device program (never in the disk cache).
        `behind`: a background build's (counted in `built_behind`). `options`: called on a miss
        only, -> XLA's compile options (`compiler_options`: the model's size and an env knob, read
        when a program is built; part of the disk cache's key, not of this LRU's).
        -> (executable, whether it was built now)."""
        shown = args if key_args is None else key_args
        if program == "forward":
            sig = (self._weights_signature(shown[0]), signature(shown[1:]))
        else:
            sig = (None, signature(shown))
        key = (program, *sig, tuple(sorted(statics.items())))
        with self._lock:
            fn = self._lru.get(key)
            if fn is not None:
                self._lru.move_to_end(key)
                return fn, False
        fn = _load_or_compile(make, args, statics, key, sharded, options() if options else None)
        with self._lock:
            self.built += 1
            self.built_behind += behind
            self._lru[key] = fn
            self._evict_to(self.capacity)
        return fn, True

    def counts(self) -> tuple[int, int]:
        """(built, built_behind), read together."""
        with self._lock:
            return self.built, self.built_behind

    def _weights_signature(self, w):
        """`signature(w)`, computed once per weights object (an engine's weights never change;
        flattening them on every step cost ~15 us on the tiny model): held by id beside a weak
        reference, so a recycled id is never mistaken for the object it once named."""
        with self._lock:
            held = self._weights.get(id(w))
            if held is not None and held[0]() is w:
                return held[1]
        sig = signature(w)
        try:
            ref = weakref.ref(w)
        except TypeError:  # a tree that takes no weak reference (a plain dict): not held
            return sig
        with self._lock:
            self._weights = {k: v for k, v in self._weights.items() if v[0]() is not None}
            self._weights[id(w)] = (ref, sig)
        return sig

    def resize(self, capacity: int) -> None:
        """Change the cap; evicts the least recently used down to it at once."""
        if capacity < 1:
            raise ValueError(f"the step executable cache needs room for at least 1 variant, not {capacity}")
        with self._lock:
            self.capacity = capacity
            self._evict_to(capacity)

    def _evict_to(self, capacity: int) -> None:
        """Drop the least recently used programs down to `capacity` (lock held); every
        TRIM_EVERY evictions also JAX's per-shape caches."""
        while len(self._lru) > capacity:
            self._lru.popitem(last=False)
            self.evicted += 1
            if self.evicted % TRIM_EVERY == 0:
                release_jax_caches()

    def held(self, program: str) -> int:
        """Programs of this name held now."""
        with self._lock:
            return sum(k[0] == program for k in self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    def check_integrity(self) -> None:
        if len(self._lru) > self.capacity:
            raise AssertionError(f"{len(self._lru)} step executables held, capacity {self.capacity}")
        if self.built - self.evicted != len(self._lru):
            raise AssertionError(f"built {self.built} - evicted {self.evicted} != held {len(self._lru)}")
        if self.built_behind > self.built:
            raise AssertionError(f"built behind {self.built_behind} > built {self.built}")


def _load_or_compile(make, args: tuple, statics: dict, key: tuple, sharded: bool, options: dict | None):
    """A single-device program from the executable cache on disk, else compiled afresh and stored
    there (exec_cache.py says why afresh); a sharded one compiled through JAX's persistent cache.
    Either compiles with XLA `options`."""
    if not sharded and exec_cache.enabled():
        name = exec_cache.key(key[:-1] + ((tuple(sorted(options.items())),) if options else ()), statics)
        fn = exec_cache.load(name, _devices(args))
        if fn is None:
            with exec_cache.fresh_compile():
                fn = make().lower(*args, **statics).compile(options)
            exec_cache.store(name, fn)
        return fn
    return make().lower(*args, **statics).compile(options)


QUICK = {"xla_backend_optimization_level": 0}


def compiler_options(cfg) -> dict | None:
    """XLA options for the programs of model `cfg`: QUICK when PDDJAX_QUICK_COMPILE_MAX_PARAMS is
    set and the model has at most that many parameters (a test model: the tiny model's forward
    compiles in 0.59 instead of 1.12 CPU s and steps in ~1.3 instead of ~0.7 ms; the real
    model's step would run 2.5x slower), else None (XLA's defaults)."""
    limit = env.QUICK_COMPILE_MAX_PARAMS.get()
    return dict(QUICK) if limit is not None and cfg.num_params <= limit else None


def _devices(args: tuple) -> list:
    """The devices of the placed arguments (one, at one device), by id; else the default one."""
    found = {d for x in jax.tree_util.tree_leaves(args) if getattr(x, "sharding", None) is not None
             for d in x.sharding.device_set}
    return sorted(found, key=lambda d: d.id) or jax.devices()[:1]


def signature(tree) -> tuple:
    """Structure, and every leaf's shape, dtype, sharding (None: numpy) and weak type."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None), getattr(x, "weak_type", False))
                          for x in leaves)


def release_jax_caches() -> None:
    """Drop JAX's per-shape tracing / lowering caches (held executables stay valid; other jitted
    functions re-lower on their next call, from the persistent cache) and trim the heap."""
    jax.clear_caches()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
