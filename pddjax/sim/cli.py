"""`pddjax sim` (scenarios) and `pddjax plan` (capacity planner) subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pddjax.cli import UserError
from pddjax.sim.specs import parse_accelerators, parse_sla, parse_traffic, parse_wans

SIM_HELP = """Scenarios:
  paper     the report's setting (64K context, 1K output, ~90% mean hit): baseline vs PDD
            BCR, TTFT vs cross-DC PD, RLD token share, bathtub, drift. Needs --json.
  validate  predicted vs measured TTFT P50/P99 of `pddjax bench serve --quick`; needs
            --measured (the benchmark's JSON) and --engine-profile (`pddjax bench engine
            --json`); best with --trace (`bench serve --save-trace`) and --calibration
            (`python -m pddjax.sim.calibrate --json F`, this host's step and overhead costs;
            default: the figures measured on the 2-core development VM, docs/sim.md)."""

PLAN_HELP = """Value formats:
  --traffic      rps=R[,context=N][,output=N][,hit=H|skewed][,turns=T][,seed=S]
                 N accepts a k suffix (64k = 65536). hit=skewed (default) is the agentic mix
                 (~3/4 of turns above 95%); hit=0.7 is a narrow mix around 70%.
  --wan-gbps     candidate line bandwidths in Gb/s, comma-separated: 10,25,50,100
  --accelerators PREFILL_SIDE[,DECODE_SIDE], each NAME[@USD_PER_CHIP_HOUR] or
                 measured:FILE (a `pddjax bench engine --json` profile). Names: h100, h200,
                 a100, l40s, tpu-v5e, gpu-a, gpu-b. P and RLD use the first, MD the second.
  --sla          ttft=SECONDS,tpot=SECONDS[,attain=FRACTION]  e.g. ttft=8,tpot=0.05,attain=0.9"""


def register(subparsers) -> None:
    p = subparsers.add_parser("sim", help="cluster-scale PDD simulator scenarios", description=SIM_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", required=True, choices=["paper", "validate"])
    p.add_argument("--json", metavar="FILE", help="write the result here")
    p.add_argument("--plots", metavar="DIR", help="write PNG figures here (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="processes for independent runs (default 2)")
    p.add_argument("--model", default="flagship-50k", help="model profile (paper scenario)")
    p.add_argument("--measured", metavar="FILE", nargs="+",
                   help="validate: the benchmark's JSON; several runs of one trace: compared with their median")
    p.add_argument("--engine-profile", metavar="FILE", help="validate: `pddjax bench engine --json` output")
    p.add_argument("--trace", metavar="FILE",
                   help="validate: the trace the benchmark replayed (default: regenerated from its JSON)")
    p.add_argument("--calibration", metavar="FILE", nargs="+",
                   help="validate: host calibration (python -m pddjax.sim.calibrate); several: predict with each, "
                        "compare their median")
    p.add_argument("--host-cores", type=float, help="validate: cores the services share (default: calibration's)")
    p.add_argument("--shared-cores", action="store_true",
                   help="validate: model every service on all cores even if the benchmark pinned them")
    p.add_argument("--background-cores", type=float,
                   help="validate: cores other processes kept busy (default: the benchmark's record, else 0)")
    p.add_argument("--wan-gbps", type=float, help="validate: emulated WAN bandwidth (default: the benchmark's)")
    p.add_argument("--wan-ms", type=float, help="validate: emulated one-way latency (default: the benchmark's)")
    p.add_argument("--jitter-ms", type=float, help="validate: emulated jitter scale (default: the benchmark's)")
    p.add_argument("--requests", action="store_true", help="validate: also print the request-by-request table")
    p.set_defaults(func=sim_handler)

    q = subparsers.add_parser("plan", help="instance counts and line that maximize BCR under an SLA",
                              description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("--traffic", required=True, help="rps=R[,context=N][,output=N][,hit=H|skewed][,turns=T]")
    q.add_argument("--wan-gbps", default="10,25,50,100", help="candidate line bandwidths (Gb/s)")
    q.add_argument("--wan-ms", type=float, default=5.0, help="one-way WAN latency in ms (default 5)")
    q.add_argument("--accelerators", default="gpu-a,gpu-b", help="PREFILL_SIDE[,DECODE_SIDE]")
    q.add_argument("--sla", default="ttft=8,tpot=0.05,attain=0.9", help="ttft=S,tpot=S[,attain=F]")
    q.add_argument("--model", default="flagship-50k")
    q.add_argument("--modes", default="pd-local,pd-cross,pdd", help="which deployments to plan")
    q.add_argument("--json", metavar="FILE")
    q.set_defaults(func=plan_handler)


def sim_handler(args) -> int:
    if args.scenario == "validate":
        return _validate(args)
    if not args.json:
        raise UserError("--scenario paper needs --json FILE for its result.")
    if args.plots:
        from pddjax.sim.plots import have_matplotlib

        if not have_matplotlib():
            raise UserError("--plots needs matplotlib; install it with `pip install matplotlib`.")
    from pddjax.sim.model import MODELS
    from pddjax.sim.scenario import paper

    if args.model.lower() not in MODELS:
        raise UserError(f"unknown model {args.model!r}; choose from {', '.join(MODELS)}.")
    result = paper(seed=args.seed, workers=args.workers, model=args.model,
                   log=lambda m: print(m, file=sys.stderr))
    _write_json(args.json, result)
    r = result["report"]
    print(f"BCR gain {100 * result['bcr_gain']:+.1f}% (report {100 * r['bcr_gain']:+.1f}%), "
          f"cost {100 * result['cost_change']:+.1f}% (report -7.1..-3.5%), "
          f"TTFT P99 vs cross {-100 * result['ttft_reduction_vs_cross']:+.1f}% (report -51.5%), "
          f"RLD token share {100 * result['rld_token_share']:.1f}% (report 6.2%); "
          f"{result['runtime_s']} s")
    if args.plots:
        from pddjax.sim.plots import paper_plots

        for path in paper_plots(result, args.plots):
            print(f"wrote {path}")
    return 0


def _validate(args) -> int:
    from pddjax.sim import calibrate
    from pddjax.sim.runs import combine
    from pddjax.sim.validate import (
        WanSettings,
        background_of,
        compare,
        cpus_of,
        ensemble,
        format_requests,
        format_table,
        load_measured,
        measured_modes,
        per_request,
        predict,
        request_agreement,
        trace_of,
        wan_of,
    )

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
        _write_json(args.json, {"predicted": predicted, "rows": rows, "requests": details, "agreement": agree,
                                "calibration": cals[0] if len(cals) == 1 else cals, "wan": wan.__dict__})
    return 0


def plan_handler(args) -> int:
    from pddjax.sim.plan_run import run_plan

    try:
        wl = parse_traffic(args.traffic)
        sla = parse_sla(args.sla)
        wans = parse_wans(args.wan_gbps)
        accs = parse_accelerators(args.accelerators, args.model)
    except ValueError as e:
        raise UserError(_sentence(str(e))) from None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("pd-local", "pd-cross", "pdd")]
    if bad or not modes:
        raise UserError(f"--modes takes pd-local, pd-cross and/or pdd, not {', '.join(bad) or 'nothing'}.")
    result = run_plan(wl, sla, wans, accs, args.wan_ms / 1e3, modes)
    print(result["table"])
    if args.json:
        _write_json(args.json, result)
    return 0


def _sentence(msg: str) -> str:
    return msg if msg.endswith(".") else msg + "."


def _write_json(path: str, obj: dict) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, default=str)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}.") from None
