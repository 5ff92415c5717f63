"""`pddjax serve ROLE --config FILE [--port N]` (one service) and `pddjax up` (the stack)."""

from __future__ import annotations

import argparse
import asyncio
import os

from pddjax.errors import UserError

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "pddjax.toml")


def register(sub) -> None:
    p = sub.add_parser("serve", help="run one PDD service (prefill, relay, main or router)")
    p.add_argument("role", choices=["prefill", "relay", "main", "router"])
    p.add_argument("--config", required=True, help="stack config (TOML or JSON), see configs/")
    p.add_argument("--port", type=int, default=None, help="listen port (default: the config's; 0 = any)")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    _security_flags(p)
    p.set_defaults(func=run_serve)

    u = sub.add_parser("up", help="start P, RLD, MD and the router on this machine behind a slowable WAN link")
    u.add_argument("--config", help="stack config (TOML or JSON); default configs/pddjax.toml")
    u.add_argument("--port", type=int, default=50051, help="router port")
    u.add_argument("--state", help="write a JSON state file (services, pids, addresses)")
    u.add_argument("--model", help="override the config's model")
    u.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override every engine's dtype")
    u.add_argument("--wan-mbps", type=float, help="A -> B bandwidth in Mb/s (0 = unlimited)")
    u.add_argument("--wan-latency-ms", type=float, help="A -> B one-way latency in ms")
    u.add_argument("--wan-capacity-mbps", type=float,
                   help="tell the router the link's provisioned A -> B rate ([router] wan_mbps: the estimate's prior "
                        "and cap; default: unknown, the router measures the link it is given)")
    u.add_argument("--instances", default="1,1,1", metavar="P,R,M",
                   help="how many prefill, relay and main instances to start (default 1,1,1)")
    _security_flags(u)
    u.set_defaults(func=run_up)


def _security_flags(p) -> None:
    p.add_argument("--tls-dir", help="ca.pem, cert.pem, key.pem: mutual TLS between services, TLS on the router "
                                     "(sets PDDJAX_TLS_DIR for this process and the services it starts)")
    p.add_argument("--auth-token-file", help="bearer token the router requires (sets PDDJAX_ROUTER_TOKEN_FILE)")


def apply_security_flags(args) -> None:
    """Flags -> environment, so every child process and client in this process sees them."""
    from serving import security

    if getattr(args, "tls_dir", None):
        os.environ[security.TLS_DIR_ENV] = os.path.abspath(args.tls_dir)
    if getattr(args, "auth_token_file", None):
        os.environ[security.TOKEN_FILE_ENV] = os.path.abspath(args.auth_token_file)
    try:
        security.tls_material.cache_clear()
        security.router_token.cache_clear()
        security.tls_material()
        security.router_token()
    except security.SecurityConfigError as e:
        raise UserError(str(e)) from None


def _die_with_parent() -> None:
    if os.environ.get("PDDJAX_DIE_WITH_PARENT") != "1":
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _pin_cpus() -> None:
    """PDDJAX_CPUS="0,1": run this service on those CPUs only (set before JAX starts, so XLA's
    thread pool is sized to them). `bench serve` gives each emulated datacenter its own cores."""
    spec = os.environ.get("PDDJAX_CPUS", "").strip()
    if not spec:
        return
    try:
        os.sched_setaffinity(0, {int(c) for c in spec.split(",")})
    except (ValueError, OSError) as e:
        raise UserError(f"cannot pin to CPUs {spec!r} (PDDJAX_CPUS): {e}") from None


def run_serve(args) -> int:
    _pin_cpus()
    apply_security_flags(args)
    from serving.config import read_file, service_config
    from serving.stack.server import serve

    cfg = service_config(read_file(args.config), args.role, args.port)
    _die_with_parent()
    import faulthandler
    import signal

    try:
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps every thread's stack to stderr
    except (AttributeError, ValueError, OSError):
        pass
    from pddjax import memdiag

    memdiag.install(args.role)  # PDDJAX_TRACEMALLOC=N: `kill -USR2 PID` prints heap growth
    asyncio.run(serve(cfg, args.ready_file))
    return 0


def load_stack(args) -> dict:
    from serving.config import ENGINE_ROLES, read_file, service_config

    if args.config is None and not os.path.exists(DEFAULT_CONFIG):
        stack = {"model": "smollm2-135m", "platform": "cpu"}  # installed without the repo's configs/
    else:
        stack = read_file(args.config or DEFAULT_CONFIG)
    if args.model:
        stack["model"] = args.model
        for r in (*ENGINE_ROLES, "router"):
            stack.get(r, {}).pop("model", None)
    if args.dtype:
        stack["engine"] = {**stack.get("engine", {}), "dtype": args.dtype}
        for r in ENGINE_ROLES:
            stack.get(r, {}).pop("dtype", None)
    wan = dict(stack.get("wan", {}))
    if args.wan_mbps is not None:
        if args.wan_mbps < 0:
            raise UserError(f"--wan-mbps must be >= 0, got {args.wan_mbps}")
        wan["mbps"] = args.wan_mbps
    if args.wan_latency_ms is not None:
        if args.wan_latency_ms < 0:
            raise UserError(f"--wan-latency-ms must be >= 0, got {args.wan_latency_ms}")
        wan["latency_ms"] = args.wan_latency_ms
    stack["wan"] = wan
    if args.wan_capacity_mbps is not None:
        if args.wan_capacity_mbps < 0:
            raise UserError(f"--wan-capacity-mbps must be >= 0, got {args.wan_capacity_mbps}")
        stack["router"] = {**stack.get("router", {}), "wan_mbps": args.wan_capacity_mbps}
    for r in (*ENGINE_ROLES, "router"):  # validate before starting anything
        service_config(stack, r)
    for r in ENGINE_ROLES:
        stack.setdefault(r, {})["port"] = 0
    return stack


def run_up(args) -> int:
    apply_security_flags(args)
    from serving.stack.up import run_stack

    try:
        instances = tuple(int(x) for x in args.instances.split(","))
    except ValueError:
        instances = ()
    if len(instances) != 3 or min(instances) < 1:
        raise UserError(f"--instances wants three counts >= 1 like 2,2,2, got {args.instances!r}")
    return asyncio.run(run_stack(load_stack(args), args.port, args.state, instances=instances))
