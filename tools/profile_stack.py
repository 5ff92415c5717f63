"""Where each service's CPU goes under `pddjax bench serving`'s load (issue 18): py-spy on P, RLD,
MD and the router while N streams run through a pipeline, aggregated per service into categories
and the top functions by self time.

One stack (serving/bench/load/command.py's config: tiny model, 1000 Mb/s / 5 ms WAN), a warm-up,
then per pipeline: `py-spy record --format raw --threads --nonblocking` on every service process
while `--repeat` bursts of `--streams` streams run one after another, and each thread's CPU
seconds from /proc over the same window. Raw files land in --out (re-read with --analyze).

  .venv/bin/python -m tools.profile_stack --streams 32 --repeat 4 --out prof
  .venv/bin/python -m tools.profile_stack --analyze prof

A sample is one stack of a thread that was running (py-spy leaves idle threads out), so the
shares are of CPU samples; time inside C (XLA, upb, gRPC's core) counts for the Python line
that called it, which `categorize` reads from the source line itself. (`py-spy --native` would
show the C frames but must pause the process per sample: throughput fell 10-50x here, so no.)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROLES = ("prefill", "relay", "main", "router")
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


# ---- collection ----------------------------------------------------------------------------
def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (comm, CPU seconds)} of every thread of `pid` now."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def record(pids: dict[str, int], out_prefix: str, rate: int, load) -> dict:
    """py-spy on every pid while `load()` runs -> {role: {tid: [comm, CPU s over the window]}}."""
    spies = {}
    for role, pid in pids.items():
        cmd = [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid", str(pid), "--format", "raw",
               "--threads", "--nonblocking", "--full-filenames", "--rate", str(rate), "-o", f"{out_prefix}.{role}.txt"]
        spies[role] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attached
    before = {role: thread_cpu(pid) for role, pid in pids.items()}
    load()
    after = {role: thread_cpu(pid) for role, pid in pids.items()}
    for p in spies.values():
        p.send_signal(signal.SIGINT)
    for role, p in spies.items():
        _, err = p.communicate(timeout=60)
        if not os.path.exists(f"{out_prefix}.{role}.txt"):
            raise RuntimeError(f"py-spy wrote nothing for {role}: {err.decode()[-500:]}")
    return {role: {tid: [comm, round(cpu - before[role].get(tid, (comm, 0.0))[1], 3)]
                   for tid, (comm, cpu) in after[role].items()} for role in pids}


def collect(args) -> None:
    from pddjax.env import STEP_LOG
    from serving.bench.load import command as sl
    from serving.bench.serve.stack import BenchStack

    os.makedirs(args.out, exist_ok=True)
    steps_dir = os.path.join(args.out, "steps")
    os.makedirs(steps_dir, exist_ok=True)
    os.environ[STEP_LOG.name] = steps_dir  # each engine thread's steps and commands (serving/engine/steplog.py)
    ns = argparse.Namespace(model="tiny", num_pages=512, max_rows=max(64, args.streams), max_step_tokens=256,
                            wan_mbps=1000.0, wan_latency_ms=5.0)
    cfg, vocab = sl.stack_config(ns), 512
    meta = {"streams": args.streams, "repeat": args.repeat, "max_tokens": args.max_tokens, "rate": args.rate,
            "stack": cfg, "load_avg_before": os.getloadavg(), "threads": {}, "bursts": {}, "windows": {}}
    with tempfile.TemporaryDirectory(prefix="pddjax-profile-") as workdir:
        stack = BenchStack(cfg, workdir)
        try:
            pids = meta["pids"] = {c.role: c.proc.pid for c in stack.children}
            for k, p in enumerate(args.pipelines.split(",")):
                sl.send_burst(stack.router, sl.make_prompts(7000 + k, 4, 32, vocab), 8, p, f"warm-{p}")
            for k, p in enumerate(args.pipelines.split(",")):
                figs = []

                def load(p=p, k=k, figs=figs):
                    for j in range(args.repeat):
                        prompts = sl.make_prompts(8000 + 100 * k + j, args.streams, 32, vocab)
                        t0, recs = sl.send_burst(stack.router, prompts, args.max_tokens, p, f"prof-{p}-{j}",
                                                 interval=args.stream_interval)
                        figs.append(sum(len(r.tokens) for r in recs) / max(r.times[-1] - t0 for r in recs if r.times))
                print(f"profile: {p} x {args.streams} streams x {args.repeat}", file=sys.stderr, flush=True)
                t_from = time.time()
                meta["threads"][p] = record(pids, os.path.join(args.out, p), args.rate, load)
                meta["windows"][p] = [t_from, time.time()]
                meta["bursts"][p] = {"tokens_per_s": [round(x, 1) for x in figs]}
        finally:
            stack.close()
    meta["load_avg_after"] = os.getloadavg()
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


# ---- analysis ----------------------------------------------------------------------------
def read_raw(path: str) -> list[tuple[int, str, list[tuple[str, str, int]], int]]:
    """-> [(tid, thread name, frames root -> leaf as (func, file, line), samples)]."""
    out = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            parts = stack.split(";")
            m = re.match(r"thread \((?:0x)?([0-9a-fA-F]+)\): ?(.*)", parts[0])
            tid, name = (int(m.group(1), 16 if "0x" in parts[0] else 10), m.group(2)) if m else (0, parts[0])
            frames = []
            for fr in parts[1:]:
                fm = _FRAME.match(fr)
                frames.append((fm["func"], fm["file"], int(fm["line"])) if fm else (fr, "", 0))
            out.append((tid, name, frames, int(n)))
    return out


_lines: dict[str, list[str]] = {}


def source_line(path: str, line: int) -> str:
    if path not in _lines:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                _lines[path] = f.read().splitlines()
        except OSError:
            _lines[path] = []
    src = _lines[path]
    return src[line - 1].strip() if 0 < line <= len(src) else ""


WAIT = ("EpollSelector.select", "_PollLikeSelector.select", "Condition.wait", "Event.wait", "Lock.acquire",
        "Thread.join", "sleep", "Queue.get", "_wait_for_tstate_lock")
WAITING = "waiting (runnable in poll / wait; not CPU)"
STEPLOG = "step log (PDDJAX_STEP_LOG: this profile's own)"
LEFT_OUT = (WAITING, STEPLOG)


def _in(names, *files) -> bool:
    return any(f.endswith(files) for _, f in names)


def categorize(frames: list[tuple[str, str, int]]) -> str:
    """One category per sample, from the frames that say what the thread was doing (first rule
    that matches). Time in C counts for the Python line that called it: the leaf's source line
    says whether that was protobuf, and a leaf `Handle._run` is a C or Cython callback of the
    event loop (gRPC aio's Cython coroutines, C futures)."""
    names = [(func, file) for func, file, _ in frames]
    leaf_func, leaf_file, leaf_line = frames[-1] if frames else ("", "", 0)
    text = source_line(leaf_file, leaf_line)
    if leaf_func in WAIT or leaf_func.endswith(".select"):
        return WAITING
    if _in(names, "serving/engine/steplog.py"):
        return STEPLOG
    if leaf_func == "BaseSelectorEventLoop._write_to_self":
        return "loop wake-ups from the engine thread (call_soon_threadsafe)"
    if any("/jax/_src/interpreters/mlir.py" in f or f.endswith(("compilation_cache.py", "compiler.py", "cache_key.py"))
           for _, f in names):
        return "JAX lowering / compile (a shape met the first time)"
    in_build = any(fn.startswith("PagedEngine._build") or fn.endswith("_sampling_arrays") for fn, _ in names)
    in_jax = any("/jax/" in f or "/jaxlib/" in f for _, f in names)
    if in_build and in_jax:
        return "host -> device arrays (jnp.asarray per step array)"
    if _in(names, "engines/step.py") or leaf_func in ("Compiled.__call__", "ExecuteReplicated.__call__") or (
            leaf_func == "PagedEngine.step" and "np.asarray(tokens)" in text):
        return "engine step (XLA executable call, result wait)"
    if any(fn.endswith("_sampling_arrays") for fn, _ in names):
        return "sampling arrays (numpy)"
    if any(fn.startswith(("PagedEngine._build", "PagedEngine.step")) for fn, _ in names) or _in(
            names, "engines/buckets.py", "kv/page_table.py", "engines/sequence.py"):
        return "batch building (rows, numpy)"
    if "_pb2." in text or "/google/protobuf/" in leaf_file or "CopyFrom" in text or "Batch(" in text:
        return "protobuf construction"
    if _in(names, "serving/router/stream.py", "serving/router/metrics.py", "serving/router/detok.py",
           "serving/router/decode_streams.py"):
        return "router per batch (stream.Output, TokenTimer, detok, DecodeStream demux)"
    if any("prometheus_client" in f for _, f in names) or _in(names, "serving/metrics.py"):
        return "metrics (prometheus)"
    if any(fn.endswith("._on_step") for fn, _ in names) or _in(names, "serving/engine/slot.py",
                                                                "serving/engine/decode_stream.py"):
        return "per-token events (on_step, slot queues, DecodeStream entries)"
    if in_jax:
        return "JAX other (KV import / export, device_put)"
    if _in(names, "serving/engine/worker.py"):
        return "engine thread loop (queue, commands)"
    if leaf_func == "Handle._run":
        return "gRPC Cython + C callbacks (leaf Handle._run)"
    if leaf_func == "Thread.run":
        return "gRPC poller thread (C)"
    if any("/grpc/" in f for _, f in names):
        return "gRPC aio (Python layer: stream reads / writes)"
    if any("/serving/" in f or "/pddjax/" in f for _, f in names):
        return "service code (other: admission, plan, KV, handoff)"
    if any("/asyncio/" in f for _, f in names):
        return "asyncio event loop"
    return "other"


def analyze(directory: str, top: int = 15) -> dict:
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    report: dict = {"meta": {k: v for k, v in meta.items() if k != "threads"}, "pipelines": {}}
    for p in meta["threads"]:
        per = {}
        for role in ROLES:
            path = os.path.join(directory, f"{p}.{role}.txt")
            if not os.path.exists(path):
                continue
            samples = read_raw(path)
            total = sum(n for *_, n in samples) or 1
            cats, selfs, by_thread = collections.Counter(), collections.Counter(), collections.Counter()
            for _, name, frames, n in samples:
                cats[categorize(frames)] += n
                if frames and categorize(frames) not in LEFT_OUT:
                    func, file, _ = frames[-1]
                    selfs[f"{func} ({_short(file)})"] += n
                by_thread[name] += n
            cpu = meta["threads"][p].get(role, {})
            split = cpu_split(cpu)
            engine_cat = "engine step (XLA executable call, result wait)"
            busy = (total - cats[WAITING] - cats[STEPLOG]) or 1
            per[role] = {"samples": total, "cpu_s": round(sum(v[1] for v in cpu.values()), 2),
                         "waiting_share": round(100 * cats.pop(WAITING, 0) / total, 1),
                         "steplog_share": round(100 * cats.pop(STEPLOG, 0) / total, 1),
                         "categories": {k: round(100 * v / busy, 1) for k, v in cats.most_common()},
                         "top_self": [(k, round(100 * v / busy, 1)) for k, v in selfs.most_common(top)],
                         "threads_samples": {k: round(100 * v / total, 1) for k, v in by_thread.most_common(6)},
                         "threads_cpu_s": _threads_cpu(cpu), "cpu_split_s": split,
                         # the engine's share of ALL the service's CPU: its Python thread's samples
                         # in the step, scaled by the Python threads' CPU, plus XLA's own threads
                         "engine_share_of_cpu": round(100 * (cats[engine_cat] / busy * split["python"] + split["xla"])
                                                      / max(1e-9, sum(split.values())), 1)}
        report["pipelines"][p] = per
        report.setdefault("steps", {})[p] = step_summary(os.path.join(directory, "steps"), meta, p)
    return report


def step_summary(steps_dir: str, meta: dict, pipeline: str) -> dict:
    """Per engine service, from its step log inside the pipeline's window: steps, their wall time,
    the shapes [T, B, MP, Q] that took the most of it, and the commands' wall time by name."""
    t0, t1 = meta.get("windows", {}).get(pipeline, (0, 0))
    out = {}
    for role, pid in meta.get("pids", {}).items():
        path = next((os.path.join(steps_dir, f) for f in (os.listdir(steps_dir) if os.path.isdir(steps_dir) else ())
                     if f.endswith(f"-{pid}.jsonl")), None)
        if path is None:
            continue
        walls, shapes, cmds = [], collections.Counter(), collections.Counter()
        with open(path) as f:
            for line in f:
                e = json.loads(line)
                if not t0 <= e.get("t", 0) <= t1:
                    continue
                if e["k"] == "step":
                    walls.append(e["wall"])
                    shapes[str(e["shape"][:4])] += e["wall"]
                elif e["k"] == "cmd":
                    cmds[e["name"]] += e["wall"]
        if walls:
            out[role] = {"steps": len(walls), "step_wall_s": round(sum(walls), 3),
                         "step_ms_p50": round(1e3 * sorted(walls)[len(walls) // 2], 2),
                         "step_ms_max": round(1e3 * max(walls), 1),
                         "top_shapes_s": {k: round(v, 3) for k, v in shapes.most_common(4)},
                         "commands_s": {k: round(v, 3) for k, v in cmds.most_common(4)}}
    return out


def cpu_split(cpu: dict) -> dict:
    """CPU s by kind of thread: Python threads (sampled by py-spy), XLA's pool (and LLVM's), gRPC's C core."""
    out = {"python": 0.0, "xla": 0.0, "grpc_c": 0.0}
    for comm, sec in cpu.values():
        kind = "xla" if comm.startswith(("tf_", "XLA", "llvm")) else "python" if comm.startswith("python") else "grpc_c"
        out[kind] += sec
    return {k: round(v, 2) for k, v in out.items()}


def _threads_cpu(cpu: dict) -> dict:
    by = collections.Counter()
    for comm, s in cpu.values():
        by[comm] += s
    return {k: round(v, 2) for k, v in by.most_common(6) if v > 0}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _short(path: str) -> str:
    for mark in ("/site-packages/", REPO, "/lib/python3"):
        if mark in path:
            return path.split(mark, 1)[1]
    return path


def markdown(report: dict) -> str:
    lines = []
    for p, per in report["pipelines"].items():
        cats = sorted({c for r in per.values() for c in r["categories"]})
        lines += [f"\n### {p}", "", "| category | " + " | ".join(per) + " |", "|---|" + "---|" * len(per)]
        for c in cats:
            lines.append(f"| {c} | " + " | ".join(f"{r['categories'].get(c, 0.0)}" for r in per.values()) + " |")
        lines.append("| CPU s (all threads) | " + " | ".join(f"{r['cpu_s']}" for r in per.values()) + " |")
        lines.append("| CPU s: Python / XLA pool / gRPC C threads | " + " | ".join(
            "{python} / {xla} / {grpc_c}".format(**r["cpu_split_s"]) for r in per.values()) + " |")
        lines.append("| engine step incl. XLA threads (% of all CPU) | " + " | ".join(
            f"{r['engine_share_of_cpu']}" for r in per.values()) + " |")
        for key, what in (("waiting_share", "waiting"), ("steplog_share", "in the step log")):
            lines.append(f"| samples {what} (% of all, left out above) | " + " | ".join(
                f"{r[key]}" for r in per.values()) + " |")
        for role, st in report.get("steps", {}).get(p, {}).items():
            lines.append(f"\n{p} / {role} engine thread: {st}")
        for role, r in per.items():
            lines += [f"\n{p} / {role}: top self ({r['samples']} samples; threads CPU s {r['threads_cpu_s']})"]
            lines += [f"  {pc:5.1f}%  {fn}" for fn, pc in r["top_self"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for the raw profiles (collect)")
    ap.add_argument("--analyze", help="re-read a folder written before; collect nothing")
    ap.add_argument("--pipelines", default="pd-local,pd-cross,pdd")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed message")
    ap.add_argument("--json", help="write the breakdown here")
    args = ap.parse_args(argv)
    directory = args.analyze or args.out
    if not directory:
        ap.error("give --out (collect and analyze) or --analyze")
    if not args.analyze:
        collect(args)
    report = analyze(directory)
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
