"""Every `PDDJAX_*` environment variable, declared and read here only (docs/settings.md lists them).

One `Knob` per variable: its name, kind, default and a one-line meaning. `knob.get()` reads
the environment at call time (a test's `monkeypatch.setenv` applies at once), treats an empty
value as unset, and answers a bad value with a UserError of one sentence naming the variable:

    from pddjax import env
    env.KV_LEASE_SECONDS.get()      # 120.0 unless PDDJAX_KV_LEASE_SECONDS says otherwise

Code that starts child processes writes variables by their declared names (`env.CPUS.name`).
The stack config (TOML) holds the settings of a deployment; these knobs are per-process
timeouts, ports, folders and diagnostics that an operator or a test sets around a process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from pddjax.errors import UserError

PREFIX = "PDDJAX_"


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(raw)
    return value


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError(raw)
    return value


def _port(raw: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ValueError(raw)
    return int(raw)


def _flag(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(raw)
    return raw == "1"


def _cpus(raw: str) -> list[int]:
    cpus = [int(c) for c in raw.split(",")]
    if any(c < 0 for c in cpus):
        raise ValueError(raw)
    return cpus


# kind -> (parser, what a good value is: the error's words)
KINDS: dict[str, tuple[Callable[[str], Any], str]] = {
    "int": (_positive_int, "a positive integer"),
    "seconds": (_seconds, "a number of seconds > 0"),
    "port": (_port, "a port number from 1 to 65535"),
    "flag": (_flag, "1 or 0"),
    "cpus": (_cpus, "a comma-separated list of CPU numbers"),
    "path": (str, "a path"),
    "text": (str, "text"),
}


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str  # PDDJAX_...
    kind: str  # a key of KINDS
    default: Any  # the value when unset or empty (None: off / not given)
    meaning: str  # one line (docs/settings.md repeats it)

    def get(self) -> Any:
        """The variable's value now, parsed; `default` when unset or empty."""
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        parse, what = KINDS[self.kind]
        try:
            return parse(raw)
        except ValueError:
            raise UserError(f"{self.name} must be {what}, got {raw!r}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())


KNOBS: dict[str, Knob] = {}  # name -> knob, in declaration order (docs/settings.md's rows)


def _knob(suffix: str, kind: str, default: Any, meaning: str) -> Knob:
    knob = Knob(PREFIX + suffix, kind, default, meaning)
    KNOBS[knob.name] = knob
    return knob


# ---- caches (pddjax.model) ------------------------------------------------------------------
CACHE_DIR = _knob("CACHE_DIR", "path", None,
                  "converted weights and content hashes (unset: ~/.cache/pddjax; `cache_dir()`)")
JIT_CACHE_DIR = _knob("JIT_CACHE_DIR", "path", None,
                      "JAX's persistent compilation cache (unset: CACHE_DIR/jit; `jit_cache_dir()`)")

# ---- engines (pddjax.engines) ---------------------------------------------------------------
STEP_EXECUTABLES = _knob("STEP_EXECUTABLES", "int", 128,
                         "compiled step variants held in memory at most (precompile raises it to its set)")
BACKGROUND_BUILD = _knob("BACKGROUND_BUILD", "flag", True,
                          "0: under ready \"cover\" a service serves on its covering set, never building the rest")
EXEC_CACHE = _knob("EXEC_CACHE", "flag", True,
                   "0: single-device step variants are traced, lowered and looked up in JAX's cache at every "
                   "start, not loaded from CACHE_DIR/exec")
FUSE_PROJECTIONS = _knob("FUSE_PROJECTIONS", "flag", True,
                         "0: engines at one device keep q / k / v and gate / up as separate matrices (A/B runs)")
QUICK_COMPILE_MAX_PARAMS = _knob("QUICK_COMPILE_MAX_PARAMS", "int", None,
                                 "models of at most this many parameters compile their step and reference programs "
                                 "at XLA's backend optimization level 0 (half the compile, twice the step: test "
                                 "models; unset: never)")
MULTIHOST_PORT = _knob("MULTIHOST_PORT", "port", None,
                       "a multi-host leader's op channel port (unset: any free one, told to the followers)")
HEARTBEAT_SECONDS = _knob("HEARTBEAT_SECONDS", "int", 30,
                          "jax.distributed heartbeat timeout: a silent process ends the instance after this")
MULTIHOST_WRITE_SECONDS = _knob("MULTIHOST_WRITE_SECONDS", "seconds", 30.0,
                                "a multi-host follower that takes no 1 MiB of an op for this long ends the instance")

# ---- engine services (serving.engine) -------------------------------------------------------
MAX_WAITING = _knob("MAX_WAITING", "int", 256,
                    "requests an engine service queues waiting for KV pages at most; past it: refused")
PUSH_STALL_SECONDS = _knob("PUSH_STALL_SECONDS", "seconds", 30.0,
                           "P gives up a KV push that made no progress for this long")
KV_PUSH_STREAM = _knob("KV_PUSH_STREAM", "flag", True,
                       "P pushes KV over one PushKVStream per decode instance (off: one PushKV call per push)")
CALL_STREAM = _knob("CALL_STREAM", "flag", True,
                    "the router's Reserve / MatchPrefix / Release to RLD and MD and HandoffTokens ride one Calls "
                    "stream per instance (off: one unary RPC each)")
KV_LEASE_SECONDS = _knob("KV_LEASE_SECONDS", "seconds", 120.0,
                         "P frees a prefill's KV pages this long after the prefill if no target acknowledged")
LEASE_SECONDS = _knob("LEASE_SECONDS", "seconds", 60.0,
                      "RLD / MD drop a reservation with no stream and no traffic for this long")
KV_WAIT_SECONDS = _knob("KV_WAIT_SECONDS", "seconds", 120.0,
                        "RLD / MD drop a reservation whose KV has not come for this long (stream open or not)")
HANDOFF_TIMEOUT_SECONDS = _knob("HANDOFF_TIMEOUT_SECONDS", "seconds", 10.0,
                                "RLD's timeout for each try of a non-final handoff chunk to MD")
HANDOFF_FINAL_SECONDS = _knob("HANDOFF_FINAL_SECONDS", "seconds", 2.0,
                              "RLD's budget for all tries of the final handoff chunk (RLD is paused meanwhile)")
DECODING_WAIT_SECONDS = _knob("DECODING_WAIT_SECONDS", "seconds", 120.0,
                              "RLD's Handoff waits at most this long for decoding (its KV) to start")
STEP_LOG = _knob("STEP_LOG", "path", None,
                 "a folder: every engine thread logs its steps and commands there as JSONL (unset: off)")
COMPILE_LOG = _knob("COMPILE_LOG", "path", None,
                    "a folder: with tools/compile_log on PYTHONPATH, every process logs each XLA compile there")

# ---- processes, ports and security (serving) ------------------------------------------------
TLS_DIR = _knob("TLS_DIR", "path", None,
                "ca.pem and <role>.pem / <role>-key.pem: TLS on every service port (unset: plaintext)")
TLS_CA = _knob("TLS_CA", "path", None,
               "the CA a public client verifies the router with (unset: TLS_DIR/ca.pem)")
ROUTER_TOKEN_FILE = _knob("ROUTER_TOKEN_FILE", "path", None,
                          "a file holding the bearer token the router requires (unset: no token)")
HEALTH_PORT = _knob("HEALTH_PORT", "port", None,
                    "a plaintext grpc.health.v1-only port for kubelet's probe (unset: none)")
METRICS_PORT = _knob("METRICS_PORT", "port", None,
                     "the /metrics endpoint's port (unset: any free one)")
CPUS = _knob("CPUS", "cpus", None,
             "pin this service to these CPUs before JAX starts (set by `up` / `bench serve`; unset: all)")
DIE_WITH_PARENT = _knob("DIE_WITH_PARENT", "flag", False,
                        "1: the process gets SIGTERM when its parent dies (set by `up` for its children)")
READY_SECONDS = _knob("READY_SECONDS", "seconds", 1200.0,
                      "`pddjax up` waits this long at most for every service to report SERVING")
OPENAI_CACHE_HITS = _knob("OPENAI_CACHE_HITS", "flag", False,
                          "1: the OpenAI gateway's responses tell the prefix caches' hits (cached_tokens; 0: never)")

# ---- diagnostics (pddjax.memdiag) -----------------------------------------------------------
TRACEMALLOC = _knob("TRACEMALLOC", "int", None,
                    "N: a service traces allocations (N frames); `kill -USR2 PID` prints heap growth")
TRACEMALLOC_ROLE = _knob("TRACEMALLOC_ROLE", "text", None,
                         "only this role traces when TRACEMALLOC is set (unset: every role)")


def check() -> None:
    """Every knob read once: the first bad value raises its UserError. The command calls this
    before it runs anything, so a bad value stops a process at start, not on a request."""
    for knob in KNOBS.values():
        knob.get()


def cache_dir() -> str:
    """CACHE_DIR, else ~/.cache/pddjax."""
    return CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "pddjax")


def jit_cache_dir() -> str:
    """JIT_CACHE_DIR, else cache_dir()/jit."""
    return JIT_CACHE_DIR.get() or os.path.join(cache_dir(), "jit")
