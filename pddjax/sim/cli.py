"""`pddjax sim` (scenarios) and `pddjax plan` (capacity planner) subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from pddjax.errors import UserError
from pddjax.sim.specs import parse_accelerators, parse_sla, parse_traffic, parse_wans

SIM_HELP = """Scenarios:
  paper     the report's setting (64K context, 1K output, ~90% mean hit): baseline vs PDD
            BCR, TTFT vs cross-DC PD, RLD token share, bathtub, drift. Needs --json.
The simulator against a real `pddjax bench serve` run on this host (calibration, validation,
step logs) is the host lab's, outside the package: `python -m tools.hostlab.validate --help`
from the repository root (tools/hostlab/README.md)."""

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
    p.add_argument("--scenario", required=True, choices=["paper"])
    p.add_argument("--json", metavar="FILE", help="write the result here")
    p.add_argument("--plots", metavar="DIR", help="write PNG figures here (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="processes for independent runs (default 2)")
    p.add_argument("--model", default="flagship-50k", help="model profile (paper scenario)")
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
