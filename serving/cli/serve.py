"""`pddjax serve ROLE --config FILE [--port N]` (one service) and `pddjax up` (the stack)."""

from __future__ import annotations

import argparse
import asyncio
import os

from pddjax import env
from pddjax.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("serve", help="run one PDD service (prefill, relay, main, router, or the openai gateway)")
    p.add_argument("role", choices=["prefill", "relay", "main", "router", "openai"])
    p.add_argument("--config", help="stack config (TOML or JSON), see configs/ (every role but openai)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: the config's; 0 = any)")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    _multihost_flags(p)
    _openai_flags(p)
    _security_flags(p)
    p.set_defaults(func=run_serve)

    u = sub.add_parser("up", help="start P, RLD, MD and the router on this machine behind a slowable WAN link")
    u.add_argument("--config", help="stack config (TOML or JSON); default: the packaged serving/default_stack.toml")
    u.add_argument("--port", type=int, default=50051, help="router port")
    u.add_argument("--openai-port", type=int, default=0,
                   help="port of the OpenAI-compatible HTTP gateway (default: any free one; its base URL is printed "
                        "and in the state file as `openai`)")
    u.add_argument("--state", help="write a JSON state file (services, pids, addresses)")
    u.add_argument("--model", help="override the config's model")
    u.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override every engine's dtype")
    u.add_argument("--max-context", type=int, metavar="TOKENS",
                   help="serve at most this many tokens (prompt + output) per request, below the model's context "
                        "(the config's max_context): narrower page tables, fewer step shapes to build")
    u.add_argument("--speculative", choices=["off", "ngram"],
                   help="speculative decoding on RLD and MD ([engine] speculative): ngram drafts by prompt lookup")
    u.add_argument("--spec-max-tokens", type=int, metavar="K",
                   help="drafts per row per step ([engine] spec_max_tokens)")
    u.add_argument("--wan-mbps", type=float, help="A -> B bandwidth in Mb/s (0 = unlimited)")
    u.add_argument("--wan-latency-ms", type=float, help="A -> B one-way latency in ms")
    u.add_argument("--wan-capacity-mbps", type=float,
                   help="tell the router the link's provisioned A -> B rate ([router] wan_mbps: the estimate's prior "
                        "and cap; default: unknown, the router measures the link it is given)")
    u.add_argument("--kv-wire", metavar="FORMAT",
                   help="KV wire format of P -> MD over the WAN ([wan] kv_wire): native (default, exact), bf16, int8, "
                        "fp8, each optionally +zstd (e.g. int8+zstd); the lossy ones trade exactness for bytes")
    u.add_argument("--instances", default="1,1,1", metavar="P,R,M",
                   help="how many prefill, relay and main instances to start (default 1,1,1)")
    _security_flags(u)
    u.add_argument("--netns", action="store_true",
                   help="root: cluster A (P, RLD, router, gateway) and cluster B (MD) in their own network namespaces, "
                        "joined by a veth pair shaped by the kernel (tc tbf for --wan-mbps; netem delay for "
                        "--wan-latency-ms where the kernel has it, else a userspace link); deploy/README.md")
    u.add_argument("--netns-user", default="nobody", metavar="USER",
                   help="with --netns: the unprivileged user every service runs as (default nobody; it must be "
                        "able to read this Python and pddjax); root keeps them root")
    u.add_argument("--tls", action="store_true",
                   help="make a development CA and per-role certificates (pddjax certs) in a new directory and run "
                        "the stack with them (the state file names it as `tls_dir`; clients need its ca.pem only); the "
                        "directory and its keys are removed when the stack stops")
    u.set_defaults(func=run_up)

    c = sub.add_parser("certs", help="make a development CA and one TLS certificate per role (for --tls-dir)")
    c.add_argument("dir", help="directory to write ca.pem and <role>.pem / <role>-key.pem into (must hold none)")
    c.add_argument("--host", action="append", default=[],
                   help="a DNS name or IP address the services are reached at (repeatable; default localhost and "
                        "127.0.0.1)")
    c.add_argument("--days", type=int, default=30, help="validity in days (default 30)")
    c.set_defaults(func=run_certs)


def _multihost_flags(p) -> None:
    """One engine instance over several hosts (pddjax/engines/multihost.py): process 0 serves gRPC,
    the others follow its steps. Override the role table's coordinator_address / num_processes / process_id."""
    g = p.add_argument_group("multi-host instance (prefill, relay, main)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's jax.distributed coordinator address")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes (hosts) of this instance")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index: 0 serves, the others follow")


def _openai_flags(p) -> None:
    """`pddjax serve openai`: the OpenAI-compatible HTTP gateway (serving/openai) in front of a router."""
    g = p.add_argument_group("openai (the HTTP gateway)")
    g.add_argument("--router", metavar="HOST:PORT", help="the router's address (openai: required)")
    g.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    g.add_argument("--model", help="openai: the served model (its name and weights fingerprint in responses; "
                                   "requests must name it; default: any name accepted); every other role: the "
                                   "model to serve instead of the config's (a name, a .gguf or a checkpoint folder)")
    g.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request names none")
    g.add_argument("--openai-port", type=int, metavar="N",
                   help="router: also serve the OpenAI gateway in the router's process on this HTTP port (0 = any; "
                        "its address in the ready file as `openai`)")
    g.add_argument("--openai-host", help="router: the co-hosted gateway's HTTP listen address (default: the router's "
                                         "host; off loopback only with HTTPS, or --insecure and no token)")
    g.add_argument("--https-cert", metavar="PEM", help="the gateway's HTTPS certificate chain (alone, or co-hosted "
                                                       "with --openai-port); with --https-key")
    g.add_argument("--https-key", metavar="PEM", help="the gateway's HTTPS private key")


def run_openai(args) -> int:
    if not args.router:
        raise UserError("pddjax serve openai needs --router HOST:PORT")
    if args.default_max_tokens < 1:
        raise UserError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    from serving.openai.server import https_config, plaintext_problem, serve

    https = https_config(args.https_cert, args.https_key)
    problem = plaintext_problem(args.host, args.insecure, token=True, https=bool(https))  # it forwards API keys
    if problem:
        raise UserError(problem)
    apply_security_flags(args)
    _die_with_parent()

    asyncio.run(serve(args.router, args.host, 8000 if args.port is None else args.port, args.model, args.ready_file,
                      args.default_max_tokens, https=https))
    return 0


def _security_flags(p) -> None:
    p.add_argument("--tls-dir", help="ca.pem and <role>.pem / <role>-key.pem per role (pddjax certs): mutual TLS "
                                     "between services with per-role authorisation, TLS on the router (sets "
                                     "PDDJAX_TLS_DIR for this process and the services it starts)")
    p.add_argument("--auth-token-file", help="bearer token the router requires (sets PDDJAX_ROUTER_TOKEN_FILE)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plaintext on a non-loopback host (config: insecure = true); never with a token")
    p.add_argument("--reflection", action="store_true", help="serve grpc reflection (config: reflection = true)")


def apply_security_flags(args, roles=()) -> None:
    """Flags -> environment, so every child process and client in this process sees them;
    the token and `roles`' TLS material are read now (a bad one: one sentence, exit 2)."""
    from serving import security

    if getattr(args, "tls_dir", None):
        os.environ[security.TLS_DIR_ENV] = os.path.abspath(args.tls_dir)
    if getattr(args, "auth_token_file", None):
        os.environ[security.TOKEN_FILE_ENV] = os.path.abspath(args.auth_token_file)
    security.clear_caches()
    security.router_token()
    for role in roles:
        security.role_material(role)


def run_certs(args) -> int:
    from serving.certs import DEFAULT_HOSTS, make_dev_certs

    if args.days < 1:
        raise UserError(f"--days must be at least 1, got {args.days}")
    try:
        files = make_dev_certs(args.dir, tuple(args.host) or DEFAULT_HOSTS, args.days)
    except (FileExistsError, OSError) as e:
        raise UserError(str(e)) from None
    print(f"pddjax certs: {len(files)} files in {args.dir} (clients of the router need only ca.pem)")
    return 0


def _die_with_parent() -> None:
    if not env.DIE_WITH_PARENT.get():
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
    cpus = env.CPUS.get()
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as e:
        raise UserError(f"cannot pin to CPUs {cpus} ({env.CPUS.name}): {e}") from None


def run_serve(args) -> int:
    if args.role == "openai":
        return run_openai(args)
    if not args.config:
        raise UserError(f"pddjax serve {args.role} needs --config FILE")
    _pin_cpus()
    apply_security_flags(args, [args.role])
    from serving.config import read_file, service_config
    from serving.stack.server import serve

    stack = read_file(args.config)
    if args.model:  # one model for the whole stack: the role's own override goes too
        stack = {**stack, "model": args.model, args.role: {k: v for k, v in stack.get(args.role, {}).items()
                                                           if k != "model"}}
    cfg = service_config(stack, args.role, args.port)
    cfg.insecure, cfg.reflection = cfg.insecure or args.insecure, cfg.reflection or args.reflection
    _apply_multihost_flags(args, cfg)
    openai = _cohosted_openai(args, cfg)
    _die_with_parent()
    if cfg.process_id > 0:  # a multi-host follower: no port, it replays process 0's device calls
        from serving.stack.server import follow_leader

        return follow_leader(cfg)
    import faulthandler
    import signal

    try:
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps every thread's stack to stderr
    except (AttributeError, ValueError, OSError):
        pass
    from pddjax import memdiag

    memdiag.install(args.role)  # PDDJAX_TRACEMALLOC=N: `kill -USR2 PID` prints heap growth
    asyncio.run(serve(cfg, args.ready_file, openai))
    return 0


def _cohosted_openai(args, cfg) -> dict | None:
    """`serve router --openai-port N [--openai-host H]`: the gateway's settings for serving/stack/server.py."""
    if args.openai_port is None:
        if args.openai_host:
            raise UserError("--openai-host needs --openai-port")
        return None
    if cfg.role != "router":
        raise UserError(f"--openai-port is for the router (it co-hosts the OpenAI gateway), not {cfg.role}")
    if args.default_max_tokens < 1:
        raise UserError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    from serving import security
    from serving.openai.server import https_config, plaintext_problem

    host = args.openai_host or cfg.host
    https = https_config(args.https_cert, args.https_key)
    problem = plaintext_problem(host, cfg.insecure, token=security.router_token() is not None, https=bool(https))
    if problem:
        raise UserError(problem)
    return {"host": host, "port": args.openai_port, "default_max_tokens": args.default_max_tokens, "https": https}


def _apply_multihost_flags(args, cfg) -> None:
    from serving.config import multihost_problem

    for flag, key in (("coordinator", "coordinator_address"), ("num_processes", "num_processes"),
                      ("process_id", "process_id")):
        if getattr(args, flag) is not None:
            if cfg.role == "router":
                raise UserError(f"--{flag.replace('_', '-')} is for an engine role, not the router")
            setattr(cfg, key, getattr(args, flag))
    problem = multihost_problem(cfg)
    if not problem and cfg.num_processes > 1:  # the op channel's rule, before anything starts
        from pddjax.addresses import host_of
        from pddjax.engines.multihost_channel import channel_problem
        from serving import security

        problem = channel_problem(host_of(cfg.coordinator_address), security.tls_dir() is not None,
                                  cfg.insecure)
    if problem:
        raise UserError(problem)


def load_stack(args) -> dict:
    from serving.config import ENGINE_ROLES, default_stack, read_file, service_config

    stack = read_file(args.config) if args.config else default_stack()
    if args.model:
        stack["model"] = args.model
        for r in (*ENGINE_ROLES, "router"):
            stack.get(r, {}).pop("model", None)
    if getattr(args, "max_context", None) is not None:
        stack["max_context"] = args.max_context  # (checked with every role's config below)
    if args.dtype:
        stack["engine"] = {**stack.get("engine", {}), "dtype": args.dtype}
        for r in ENGINE_ROLES:
            stack.get(r, {}).pop("dtype", None)
    for flag, key in (("speculative", "speculative"), ("spec_max_tokens", "spec_max_tokens")):
        if getattr(args, flag, None) is not None:  # (checked with each role's engine table below)
            stack["engine"] = {**stack.get("engine", {}), key: getattr(args, flag)}
            for r in ENGINE_ROLES:
                stack.get(r, {}).pop(key, None)
    wan = dict(stack.get("wan", {}))
    if args.wan_mbps is not None:
        if args.wan_mbps < 0:
            raise UserError(f"--wan-mbps must be >= 0, got {args.wan_mbps}")
        wan["mbps"] = args.wan_mbps
    if args.wan_latency_ms is not None:
        if args.wan_latency_ms < 0:
            raise UserError(f"--wan-latency-ms must be >= 0, got {args.wan_latency_ms}")
        wan["latency_ms"] = args.wan_latency_ms
    if args.kv_wire is not None:
        wan["kv_wire"] = args.kv_wire  # checked with the router's config below
        stack.get("router", {}).pop("kv_wire", None)
    stack["wan"] = wan
    if args.wan_capacity_mbps is not None:
        if args.wan_capacity_mbps < 0:
            raise UserError(f"--wan-capacity-mbps must be >= 0, got {args.wan_capacity_mbps}")
        stack["router"] = {**stack.get("router", {}), "wan_mbps": args.wan_capacity_mbps}
    for flag in ("insecure", "reflection"):
        if getattr(args, flag, False):
            stack[flag] = True
    for r in (*ENGINE_ROLES, "router"):  # validate before starting anything
        service_config(stack, r)
    for r in ENGINE_ROLES:
        stack.setdefault(r, {})["port"] = 0
    return stack


def run_up(args) -> int:
    stack = load_stack(args)
    if not args.tls:
        return _run_up(args, stack)
    import shutil
    import tempfile

    if args.tls_dir:
        raise UserError("give --tls (make development certificates) or --tls-dir DIR (use these), not both")
    args.tls_dir = tempfile.mkdtemp(prefix="pddjax-tls-")
    try:
        return _run_up(args, stack)
    finally:  # the development keys live as long as the stack
        shutil.rmtree(args.tls_dir, ignore_errors=True)


def _run_up(args, stack: dict) -> int:
    from serving import security

    if args.tls:
        from serving.certs import DEFAULT_HOSTS, make_dev_certs

        host = stack.get("host", "127.0.0.1")
        extra = ()
        if args.netns:  # MD's and the router's addresses in their namespaces
            from serving.stack.netns import HOST_A, WAN_B

            extra = (WAN_B, HOST_A)
        make_dev_certs(args.tls_dir, DEFAULT_HOSTS + tuple(h for h in (host, *extra) if h not in DEFAULT_HOSTS))
        print(f"pddjax up: development TLS certificates in {args.tls_dir} (clients need its ca.pem only)", flush=True)
    apply_security_flags(args, security.ROLES)
    from serving.stack.up import run_stack

    try:
        instances = tuple(int(x) for x in args.instances.split(","))
    except ValueError:
        instances = ()
    if len(instances) != 3 or min(instances) < 1:
        raise UserError(f"--instances wants three counts >= 1 like 2,2,2, got {args.instances!r}")
    if args.netns:
        from serving.stack.netns_up import run_netns_stack

        return asyncio.run(run_netns_stack(stack, args.port, args.state, instances, args.openai_port,
                                           service_user=args.netns_user))
    return asyncio.run(run_stack(stack, args.port, args.state, instances=instances,
                                 openai_port=args.openai_port))
