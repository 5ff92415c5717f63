"""Predicted against measured: the simulator's TTFT for `pddjax bench serve --quick`.

Inputs:
- the benchmark's JSON (`pddjax bench serve --json FILE`): `modes.<mode>.ttft_ms` {p50, p99, ...},
  `requests.<mode>` (per request: request_id, pipeline, ttft_ms, ...), `wan` {mbps, latency_ms,
  jitter_ms}, `trace.config` (the generated workload, used when no trace file is given);
- this machine's engine profile (`pddjax bench engine --json FILE`, see
  `pddjax/sim/measured.py`), optionally with the host calibration (`python -m
  tools.hostlab.calibrate`, `pddjax/sim/engine_steps.py`);
- the trace the benchmark replayed (`bench serve --save-trace FILE`), for an exact replay.

The simulation reproduces the benchmark (`serving/bench/serve/command.py`, `serving/bench/serve/replay.py`):
one P, one RLD, one MD instance, all on one host whose `HostConfig.cores` they share
(`pddjax/sim/host.py`), each running step by step as pddjax's engines do
(`pddjax/sim/engine_prefill.py`, `pddjax/sim/decode.py`); the history turns
first on an unshaped line, then the router restarted (fresh estimates, prior = the line's
rate) and the measured turns from t0 on the shaped line (a FIFO, as the emulator is),
closed loop within each session; tokens reach the user from MD directly (the router talks
to MD without the WAN); `background_cores` of other processes if the benchmark recorded
them (`modes.<mode>.host.background_cores`) or the caller gives them. Modes:
pdd -> "pdd" with the router's policy settings, pd-cross -> "pd-cross", pd-local -> "pd-local"
(RLD is the local decoder), pdd-drc-off -> "pdd" without MD's DRC.

    python -m tools.hostlab.validate --measured RUN.json [RUN2.json ...] --engine-profile E \
        [--trace T] [--calibration C [C2 ...]] [--requests] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pddjax.errors import UserError
from pddjax.sim.cluster import Cluster
from pddjax.sim.config import ClusterConfig, HostConfig, Pool
from pddjax.sim.measured import MeasuredInstance
from pddjax.workload.trace import TraceRequest
from serving.config import RouterSettings
from tools.hostlab import calibrate
from tools.hostlab.runs import STATS, combine

MODES = ("pdd", "pd-cross", "pd-local", "pdd-drc-off")
TOLERANCE = 0.25
# The emulator queues every byte P writes in one FIFO per direction (no backpressure) and
# gRPC's flow-control windows let P keep megabytes queued there, so a hot turn's delta waits
# behind a cold context's KV: FIFO (per P step) is closer than fair sharing (tools/hostlab/README.md).
WAN_SHARING = "fifo"
BENCH_PIPELINE = {"P-MD": "pd-cross", "P-RLD-MD": "pdd", "P-RLD*": "pdd", "P-RLD": "pd-local", "P-D": "pd-local"}


@dataclass(frozen=True)
class WanSettings:
    mbps: float
    latency_ms: float
    jitter_ms: float = 0.0  # scale of |N(0, j)| (the benchmark's default jitter distribution)


ROUTER = RouterSettings()  # the router's defaults, as `pddjax up` runs it


def background_of(measured: dict, mode: str) -> float | None:
    """Cores other processes kept busy during the mode, if the benchmark recorded it
    (`modes.<mode>.host.background_cores`)."""
    x = ((measured["modes"].get(mode) or {}).get("host") or {}).get("background_cores")
    return float(x) if isinstance(x, (int, float)) and x >= 0 else None


def cpus_of(measured: dict) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The cores `bench serve` pinned each service to (its `cpus`), as HostConfig.cpus;
    () for an unpinned run (every service shares the host)."""
    cpus = measured.get("cpus") or {}
    if not isinstance(cpus, dict):
        raise ValueError("the benchmark's `cpus` is not a mapping of service to cores")
    return tuple(sorted((str(r), tuple(int(c) for c in cs)) for r, cs in cpus.items() if cs))


def mode_config(mode: str, perf: MeasuredInstance, wan: WanSettings, host: HostConfig,
                router: RouterSettings = ROUTER) -> ClusterConfig:
    """The simulated deployment of one benchmark mode."""
    sim_mode = {"pdd": "pdd", "pd-cross": "pd-cross", "pd-local": "pd-local", "pdd-drc-off": "pdd"}[mode]
    gbps = wan.mbps / 1e3
    return ClusterConfig(
        mode=sim_mode, p=Pool(perf, 1), d=Pool(perf, 1), rld=Pool(perf, 1) if sim_mode == "pdd" else None,
        wan_gbps=gbps, wan_latency_s=wan.latency_ms / 1e3,
        wan_jitter_s=wan.jitter_ms / 1e3 * math.sqrt(2 / math.pi),  # mean of |N(0, j)|
        wan_sharing=WAN_SHARING, fast_gbps=10.0, fast_latency_s=50e-6, handoff="chunked",
        chunk_threshold=router.handoff_threshold,
        rld_threshold_s=router.ttft_budget_ms / 1e3, filter_cap=router.filter_cap, filter_window=router.filter_window,
        drift_tolerance=router.drift_tolerance, rld_prior_tokens_per_s=router.rld_tokens_per_s_prior,
        wan_prior_gbps=gbps, cancel_late_transfers=False, link_timing="wire", user_lag_s=0.0,
        drc=mode != "pdd-drc-off",
        tpot_target_s=10.0, host=host,
    )


def pct(xs) -> dict:
    """The benchmark's percentiles (numpy's linear interpolation), in the unit given."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "n": 0}
    a = np.asarray(xs, dtype=np.float64)  # [n]
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "mean": float(a.mean()), "n": int(a.size)}


def simulate_mode(mode: str, perf: MeasuredInstance, wan: WanSettings, host: HostConfig,
                  trace: list[TraceRequest], router: RouterSettings = ROUTER) -> dict:
    """{"ttft_ms": pct, "pipelines", "requests": [...], ...} for the measured turns of one mode."""
    cl = Cluster(mode_config(mode, perf, wan, host, router), trace, horizon=math.inf, replay_history=True)
    cl.run()
    cl.check_integrity()
    reqs = sorted(cl.measured(), key=lambda r: (r.arrival, r.rid))
    pipes: dict[str, int] = {}
    for r in reqs:
        name = BENCH_PIPELINE[r.pipeline]
        pipes[name] = pipes.get(name, 0) + 1
    out_tokens = sum(r.output for r in reqs) or 1
    return {
        "ttft_ms": pct([1e3 * r.ttft for r in reqs]),
        "tpot_ms": pct([1e3 * r.tpot for r in reqs if r.output > 1]),
        "e2e_ms": pct([1e3 * (r.finish - r.arrival) for r in reqs]),
        "wall_s": max(r.finish for r in reqs) - cl.t0 if reqs else 0.0,
        "pipelines": pipes,
        "rld_token_share": sum(r.rld_tokens for r in reqs) / out_tokens,
        "wan_bytes": float(sum(r.wan_bytes for r in reqs)),
        "history_s": cl.t0,
        "new_step_shapes": cl.new_shapes(),
        "step_shapes": sorted({k for i in [*cl.P, *cl.D, *cl.R] for k in cl.step_model(i).shapes}),
        "cpu_s": _cpu_by_role(cl.measured_cpu_s(), mode),
        "steps": _steps_by_role(cl.measured_steps(), mode),
        "host_utilization": (sum(h.busy_s for h in cl.hosts.values())
                             / (cl.loop.now * sum(h.cores for h in cl.hosts.values())) if cl.loop.now else 0.0),
        "requests": [{"request_id": r.rid, "pipeline": BENCH_PIPELINE[r.pipeline], "ttft_ms": 1e3 * r.ttft,
                      "send_s": r.arrival - cl.t0, "queue_s": r.prefill_start - r.arrival,
                      "prefill_s": r.prefill_end - r.prefill_start, "p_hit": r.p_hit, "md_hit": r.md_hit,
                      "prompt": r.prompt, "output": r.output, "rld_tokens": r.rld_tokens} for r in reqs],
    }


def _role_of(owner: str, mode: str) -> str:
    """The `bench serve` service of a simulated owner (p0, p0-loop, d0, rld0)."""
    if owner.startswith("p"):
        return "prefill"
    return "relay" if owner.startswith("rld") or mode == "pd-local" else "main"  # pd-local decodes on RLD's service


def _cpu_by_role(by_owner: dict[str, float], mode: str) -> dict[str, float]:
    """Owners (p0, p0-loop, d0, rld0) -> the services `bench serve` records CPU time for."""
    out: dict[str, float] = {}
    for owner, s in by_owner.items():
        role = _role_of(owner, mode)
        out[role] = round(out.get(role, 0.0) + s, 2)
    return out


def _steps_by_role(by_engine: dict[str, tuple[int, float]], mode: str) -> dict[str, list]:
    """Engines (p0, d0, rld0) -> [steps, solo seconds] per service."""
    out: dict[str, list] = {}
    for name, (n, sec) in by_engine.items():
        have = out.setdefault(_role_of(name, mode), [0, 0.0])
        have[0] += n
        have[1] = round(have[1] + sec, 2)
    return out


def predict(perf: MeasuredInstance, wan: WanSettings, host: HostConfig, trace: list[TraceRequest],
            modes=MODES, router: RouterSettings = ROUTER, background: dict | None = None) -> dict:
    """Simulated {"modes": {mode: simulate_mode(...)}} for the given benchmark modes
    (`background`: per mode, cores other processes used, overriding host.background_cores)."""
    out = {}
    for m in modes:
        h = host
        if background and background.get(m) is not None:
            h = dataclasses.replace(host, background_cores=background[m])
        out[m] = simulate_mode(m, perf, wan, h, trace, router)
    return {"modes": out}


def load_measured(path: str | Path) -> dict:
    """Read and check the benchmark JSON; ValueError with a sentence if it is unusable."""
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e.msg})") from None
    modes = obj.get("modes") if isinstance(obj, dict) else None
    if not isinstance(modes, dict) or not any(m in modes for m in MODES):
        raise ValueError(f"{path} has no 'modes' object with any of {', '.join(MODES)}")
    for m, v in modes.items():
        if m in MODES and not all(isinstance(v.get("ttft_ms", {}).get(s), (int, float)) for s in STATS):
            raise ValueError(f"{path}: mode {m!r} lacks numeric ttft_ms p50 and p99")
    return obj


def wan_of(measured: dict) -> WanSettings | None:
    """The emulated WAN the benchmark recorded, if any."""
    w = measured.get("wan")
    if not isinstance(w, dict) or not isinstance(w.get("mbps"), (int, float)) or w["mbps"] <= 0:
        return None
    return WanSettings(float(w["mbps"]), float(w.get("latency_ms", 0.0)), float(w.get("jitter_ms", 0.0)))


def trace_of(measured: dict, path: str | Path | None = None) -> list[TraceRequest]:
    """The replayed trace: the file if given, else regenerated from the benchmark's recorded
    workload config; ValueError with a sentence if neither is available."""
    from pddjax.workload import generate, read_trace
    from pddjax.workload.config import WorkloadConfig

    if path:
        return read_trace(path)
    cfg = (measured.get("trace") or {}).get("config")
    if not isinstance(cfg, dict):
        raise ValueError("the benchmark JSON records no workload config: pass the trace with "  # noqa: TRY004
                         "--trace FILE (`pddjax bench serve --save-trace FILE`)")
    try:
        wl = WorkloadConfig(**{**cfg, "hit_mix": tuple(tuple(b) for b in cfg.get("hit_mix", ()))})
    except TypeError as e:
        raise ValueError(f"the benchmark's workload config is not usable ({e})") from None
    return generate(wl)


def measured_modes(measured: dict) -> list[str]:
    return [m for m in MODES if m in measured["modes"]]


def ensemble(preds: list[dict]) -> dict:
    """Predictions of one trace under several calibrations (the host's costs measured at
    different times) as one: each mode's TTFT P50 / P99 is the median over calibrations, each
    calibration's value kept in `ttft_calibrations`; everything else is the first one's."""
    if len(preds) == 1:
        return preds[0]
    out = {"modes": {}}
    for mode, first in preds[0]["modes"].items():
        vals = {stat: [p["modes"][mode]["ttft_ms"][stat] for p in preds] for stat in STATS}
        med = {k: float(np.median(v)) for k, v in vals.items()}
        out["modes"][mode] = {**first, "ttft_ms": {**first["ttft_ms"], **med}, "ttft_calibrations": vals}
    return out


def compare(predicted: dict, measured: dict) -> list[dict]:
    """Rows {mode, stat, predicted_ms, measured_ms, error, ok} for modes present in both."""
    rows = []
    for mode in MODES:
        if mode not in measured["modes"] or mode not in predicted["modes"]:
            continue
        for stat in STATS:
            p = predicted["modes"][mode]["ttft_ms"][stat]
            m = float(measured["modes"][mode]["ttft_ms"][stat])
            err = (p - m) / m if m else float("inf")
            rows.append({"mode": mode, "stat": stat, "predicted_ms": p, "measured_ms": m,
                         "error": err, "ok": abs(err) <= TOLERANCE,
                         "runs": measured["modes"][mode].get("ttft_runs", {}).get(stat),
                         "calibrations": predicted["modes"][mode].get("ttft_calibrations", {}).get(stat)})
    return rows


def request_agreement(rows: list[dict]) -> dict:
    """Of the per-request rows: the share within 25% and 50%, and the median |log ratio|."""
    if not rows:
        return {"n": 0}
    ratios = [r["predicted_ms"] / r["measured_ms"] for r in rows if r["measured_ms"] > 0]
    logs = sorted(abs(math.log(x)) for x in ratios if x > 0)
    return {"n": len(ratios), "within_25": sum(abs(x - 1) <= 0.25 for x in ratios) / len(ratios),
            "within_50": sum(abs(x - 1) <= 0.5 for x in ratios) / len(ratios),
            "median_abs_log_ratio": logs[len(logs) // 2] if logs else None}


def per_request(predicted: dict, measured: dict, mode: str) -> list[dict]:
    """Request by request: measured and predicted TTFT and pipeline (requests in both)."""
    sim = {r["request_id"]: r for r in predicted["modes"][mode]["requests"]}
    out = []
    for r in (measured.get("requests") or {}).get(mode, []):
        s = sim.get(r["request_id"])
        if s is None or r.get("ttft_ms") is None:
            continue
        out.append({"request_id": r["request_id"], "measured_ms": r["ttft_ms"], "predicted_ms": s["ttft_ms"],
                    "measured_pipeline": r.get("pipeline"), "predicted_pipeline": s["pipeline"],
                    "hit": r.get("hit"), "cached_on_main": r.get("cached_on_main"), "md_hit": s["md_hit"],
                    "queue_s": s["queue_s"], "prefill_s": s["prefill_s"]})
    return out


def format_table(rows: list[dict]) -> str:
    """Markdown table of `compare` rows."""
    runs = any(r.get("runs") for r in rows)  # several runs: measured = their median; show each
    cals = any(r.get("calibrations") for r in rows)  # several calibrations: predicted = their median
    lines = ["| mode | TTFT | predicted ms | measured ms | error | within 25% |"
             + (" runs (ms) | run spread |" if runs else "") + (" predicted per calibration (ms) |" if cals else ""),
             "|---|---|---:|---:|---:|---|" + ("---|---:|" if runs else "") + ("---|" if cals else "")]
    for r in rows:
        line = (f"| {r['mode']} | {r['stat']} | {r['predicted_ms']:.0f} | {r['measured_ms']:.0f} | "
                f"{100 * r['error']:+.0f}% | {'yes' if r['ok'] else 'NO'} |")
        if runs and r.get("runs"):
            xs = r["runs"]
            line += f" {' / '.join(f'{x:.0f}' for x in xs)} | {100 * (max(xs) - min(xs)) / r['measured_ms']:.0f}% |"
        if cals and r.get("calibrations"):
            line += f" {' / '.join(f'{x:.0f}' for x in r['calibrations'])} |"
        lines.append(line)
    return "\n".join(lines)


def format_requests(rows: list[dict]) -> str:
    """Markdown table of `per_request` rows."""
    lines = ["| request | hit | measured ms | predicted ms | pipeline measured / sim | MD hit measured / sim |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['request_id']} | {r['hit']:.2f} | {r['measured_ms']:.0f} | {r['predicted_ms']:.0f} | "
                     f"{r['measured_pipeline']} / {r['predicted_pipeline']} | {r['cached_on_main']} / {r['md_hit']} |")
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------
PROG = "python -m tools.hostlab.validate"
HELP = """Predicted vs measured TTFT P50/P99 of `pddjax bench serve --quick`. Needs --measured
(the benchmark's JSON) and --engine-profile (`pddjax bench engine --json`); best with --trace
(`bench serve --save-trace`) and --calibration (`python -m tools.hostlab.calibrate --json F`,
this host's step and overhead costs; default: the figures measured on the 2-core development
VM, tools/hostlab/README.md)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measured", metavar="FILE", nargs="+",
                   help="the benchmark's JSON; several runs of one trace: compared with their median")
    p.add_argument("--engine-profile", metavar="FILE", help="`pddjax bench engine --json` output")
    p.add_argument("--trace", metavar="FILE",
                   help="the trace the benchmark replayed (default: regenerated from its JSON)")
    p.add_argument("--calibration", metavar="FILE", nargs="+",
                   help="host calibration (python -m tools.hostlab.calibrate); several: predict with each, "
                        "compare their median")
    p.add_argument("--host-cores", type=float, help="cores the services share (default: calibration's)")
    p.add_argument("--shared-cores", action="store_true",
                   help="model every service on all cores even if the benchmark pinned them")
    p.add_argument("--background-cores", type=float,
                   help="cores other processes kept busy (default: the benchmark's record, else 0)")
    p.add_argument("--wan-gbps", type=float, help="emulated WAN bandwidth (default: the benchmark's)")
    p.add_argument("--wan-ms", type=float, help="emulated one-way latency (default: the benchmark's)")
    p.add_argument("--jitter-ms", type=float, help="emulated jitter scale (default: the benchmark's)")
    p.add_argument("--requests", action="store_true", help="also print the request-by-request table")
    p.add_argument("--json", metavar="FILE", help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    """The validation command; a user error is one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    missing = [m for m in args.measured or [] if not Path(m).is_file()]
    if not args.measured or missing:
        raise UserError(f"no measured benchmark file{' ' + missing[0] if missing else ''}: run `pddjax bench serve "
                        "--quick --json FILE` and pass it with --measured FILE.")
    if not args.engine_profile or not Path(args.engine_profile).is_file():
        raise UserError("no engine profile: run `pddjax bench engine --json FILE` and pass it "
                        "with --engine-profile FILE.")
    try:
        measured = combine([load_measured(m) for m in args.measured])
        cals = [calibrate.load(c) for c in args.calibration] if args.calibration else [dict(calibrate.DEFAULT)]
        for cal in cals:
            if args.host_cores is not None:
                cal["cores"] = args.host_cores
            if args.background_cores is not None:
                cal["background_cores"] = args.background_cores
        with open(args.engine_profile, encoding="utf-8") as f:
            engine_json = json.load(f)
        setups = [(calibrate.profile(engine_json, cal),
                   calibrate.host_config(cal, cpus=() if args.shared_cores else cpus_of(measured))) for cal in cals]
        trace = trace_of(measured, args.trace)
    except (ValueError, OSError) as e:
        raise UserError(_sentence(str(e))) from None
    wan = wan_of(measured)
    if args.wan_gbps is not None or wan is None:
        if args.wan_gbps is None:
            raise UserError("the benchmark JSON records no WAN settings: pass --wan-gbps, --wan-ms, --jitter-ms.")
        wan = WanSettings(1e3 * args.wan_gbps, 20.0, 0.0)
    wan = WanSettings(wan.mbps, wan.latency_ms if args.wan_ms is None else args.wan_ms,
                      wan.jitter_ms if args.jitter_ms is None else args.jitter_ms)
    modes = measured_modes(measured)
    background = None if args.background_cores is not None else {m: background_of(measured, m) for m in modes}
    predicted = ensemble([predict(perf, wan, host, trace, modes, background=background) for perf, host in setups])
    rows = compare(predicted, measured)
    print(format_table(rows))
    details = {m: per_request(predicted, measured, m) for m in modes}
    agree = {m: request_agreement(details[m]) for m in modes}
    for m in modes:
        a, pm, mm = agree[m], predicted["modes"][m], measured["modes"][m]
        if a["n"]:
            hist = mm.get("history_s")
            print(f"{m}: {a['n']} requests, {100 * a['within_25']:.0f}% within 25%, {100 * a['within_50']:.0f}% "
                  f"within 50% of their measured TTFT; history phase {pm['history_s']:.1f} s"
                  + (f" (measured {hist:.1f} s)" if isinstance(hist, (int, float)) else "")
                  + f"; step shapes first used while measuring {pm['new_step_shapes']}")
            if isinstance(mm.get("cpu_s"), dict):  # bench serve records each process's CPU time
                print("  CPU s during the measured phase, measured / sim: " + ", ".join(
                    f"{r} {mm['cpu_s'].get(r, float('nan')):.1f} / {pm['cpu_s'].get(r, 0.0):.1f}"
                    for r in ("prefill", "relay", "main")) + "; not simulated: " + ", ".join(
                    f"{r} {v:.1f}" for r, v in mm["cpu_s"].items() if r not in ("prefill", "relay", "main")))
                print("  engine steps in the measured phase (sim): " + ", ".join(
                    f"{r} {n} steps, {s:.1f} s alone" for r, (n, s) in pm.get("steps", {}).items()))
    if args.requests:
        for m in modes:
            print(f"\n{m}:\n" + format_requests(details[m]))
    if args.json:
        result = {"predicted": predicted, "rows": rows, "requests": details, "agreement": agree,
                  "calibration": cals[0] if len(cals) == 1 else cals, "wan": wan.__dict__}
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1, default=str)
        except OSError as e:
            raise UserError(f"cannot write {args.json}: {e.strerror}.") from None
    return 0


def _sentence(msg: str) -> str:
    return msg if msg.endswith(".") else msg + "."


if __name__ == "__main__":
    raise SystemExit(main())
