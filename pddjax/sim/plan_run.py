"""`pddjax plan`: plan each requested deployment kind for one traffic and tabulate them.

pd-local puts P and D on the prefill-side accelerator in one datacenter; pd-cross puts D on
the decode-side accelerator across the line (no relay); pdd adds RLD on the prefill side.
For each, `planner.cheapest` finds the least-cost pool sizes meeting the SLA at the traffic's
rate (and, across the line, the narrowest passing bandwidth); BCR = rate / cost. As in the
paper scenario, decode steps are capped at 80% of the TPOT SLA and RLD masks transfers
predicted to take more than 10% of the TTFT SLA.
"""

from __future__ import annotations

from pddjax.sim.config import ClusterConfig, Pool, Sla
from pddjax.sim.planner import cheapest
from pddjax.workload.config import WorkloadConfig


def run_plan(wl: WorkloadConfig, sla: Sla, wans: list[float], accs, wan_latency_s: float,
             modes: list[str]) -> dict:
    """Plan every mode in `modes`; JSON-ready result with a markdown `table`."""
    a, b = accs
    rps = wl.request_rate  # the offered rate asked for (planner converts to a nominal rate)
    plans = {}
    for mode in modes:
        d = a if mode == "pd-local" else b
        base = ClusterConfig(mode, Pool(a, 1), Pool(d, 1), Pool(a, 1) if mode == "pdd" else None,
                             wan_gbps=max(wans), wan_latency_s=wan_latency_s, tpot_target_s=0.8 * sla.tpot_s,
                             rld_threshold_s=0.1 * sla.ttft_s)
        plans[mode] = cheapest(base, rps, wl, sla, wans).to_json()
    rows = ["| deployment | P | RLD | D/MD | line Gb/s | cost USD/h | BCR req/USD | TTFT p50/p99 s | TPOT p90 ms "
            "| RLD share |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for mode, p in plans.items():
        if not p["feasible"]:
            rows.append(f"| {mode} | no deployment met the SLA within the search limits | | | | | | | | |")
            continue
        dep = p["deployment"]
        dd = dep.get("MD") or dep.get("D")
        rld = dep["RLD"]["count"] if dep.get("RLD") else 0
        line = f"{dep['wan_gbps']:g}" if mode != "pd-local" else "-"
        rows.append(
            f"| {mode} | {dep['P']['count']} x {dep['P']['instance']} | {rld} | {dd['count']} x {dd['instance']} | "
            f"{line} | {p['cost_per_hour']:.1f} | {3600 * p['bcr']:.1f} | "
            f"{p['ttft_ms']['p50'] / 1e3:.2f} / {p['ttft_ms']['p99'] / 1e3:.2f} | {p['tpot_ms']['p90']:.1f} | "
            f"{100 * (p['rld_token_share'] or 0):.1f}% |")
    header = (f"traffic {rps:.2f} req/s offered; SLA: {100 * sla.attain:.0f}% of requests with "
              f"TTFT <= {sla.ttft_s:g} s and TPOT <= {1e3 * sla.tpot_s:g} ms")
    return {"rps": rps, "sla": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s, "attain": sla.attain},
            "plans": plans, "table": header + "\n\n" + "\n".join(rows)}
