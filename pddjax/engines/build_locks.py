"""One compile per program per machine: the services of a stack (and the test stacks of a run)
share JAX's persistent compilation cache, and without coordination P and MD, which run the
same programs when their engine tables agree, compile each one side by side at start.

`BuildLocks` keeps one lock file per program under the JIT cache folder (`locks/`), named by a
hash of what makes the program (the model's fingerprint, the engine settings its shapes and
dtypes come from, the backend, the step shape). `build_in_turn` builds a list of shapes taking
first those no other process is building (a non-blocking `flock`); when every shape left is
being built elsewhere it waits for the first one, whose build then reads the other process's
result from the cache. A lock dies with its process (flock), so a crashed builder holds up
nobody. A wrong or missing key costs only sharing, never correctness: the cache itself checks
what it returns.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os

from pddjax import env

PROGRAM_FIELDS = ("dtype", "page_size", "num_pages", "attention", "tensor_parallel")  # EngineConfig's part
SAMPLER_FIELDS = ("tensor_parallel",)  # a sampler's program depends on the model's vocabulary and the mesh alone


class BuildLocks:
    def __init__(self, folder: str | None, identity: str):
        self.folder, self.identity = folder, identity
        if folder:
            os.makedirs(folder, exist_ok=True)

    @classmethod
    def for_engine(cls, engine, fields: tuple = PROGRAM_FIELDS) -> BuildLocks:
        """The locks of an engine's step forwards (`fields`: SAMPLER_FIELDS for its samplers, which
        engines of one model share whatever their pool)."""
        import jax

        cfg = engine.config
        ident = "|".join([engine.fingerprint, jax.default_backend(), jax.__version__,
                          *(f"{f}={getattr(cfg, f)}" for f in fields)])
        return cls(os.path.join(env.jit_cache_dir(), "locks"), ident)

    def _path(self, shape) -> str:
        digest = hashlib.sha256(f"{self.identity}|{tuple(shape)}".encode()).hexdigest()[:24]
        return os.path.join(self.folder, f"{digest}.lock")

    @contextlib.contextmanager
    def held(self, shape, wait: bool):
        """Yields True with the shape's lock held (waiting for it with `wait`), False when another
        process holds it and not `wait`. No folder: always True, nothing held."""
        if not self.folder:
            yield True
            return
        fd = os.open(self._path(shape), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def build_in_turn(shapes: list, locks: BuildLocks, build, on_built=lambda shape: None, reorder=None) -> None:
    """`build(shape)` for every shape, each under its lock: free ones first, in order; when all
    that are left are locked elsewhere, the first of them once its lock is free. `reorder(todo)`,
    if given, may reorder what is left (in place) before each pick."""
    todo = list(shapes)
    while todo:
        if reorder is not None:
            reorder(todo)
        for shape in todo:
            with locks.held(shape, wait=False) as mine:
                if mine:
                    build(shape)
                    break
        else:
            shape = todo[0]
            with locks.held(shape, wait=True):
                build(shape)  # (another process just built it: a read from the cache)
        todo.remove(shape)
        on_built(shape)
