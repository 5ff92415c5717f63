"""`bench serve --peer`'s figures: each client's TTFT, ITL and TPOT (p50, p99) on the same load,
the peer's over ours, and the ones beyond the tolerance (10%).

Definitions, vLLM's: TTFT = send -> first token-carrying message; ITL = the gaps between a
request's token-carrying messages, one per message, pooled over the requests; TPOT = (e2e - TTFT)
/ (output tokens - 1) per request, e2e = send -> last token-carrying message. Ours come from
`replay.Record` (`ttft_ms`, `itl_message_ms`, `tpot_ms`, `e2e_ms`), the peer's from its own
summary (AIPerf's percentiles; `peer_aiperf.read_summary`) and, beside them, from its records
with our percentiles (`figures.pct`, numpy's linear interpolation), so a difference in how the
percentile is taken shows apart from a difference in what was measured.
"""

from __future__ import annotations

from serving.bench.serve.figures import pct

FIGURES = ("ttft_ms", "itl_ms", "tpot_ms")
STATS = ("p50", "p99")
TOLERANCE = 0.10


def ours(records) -> dict:
    """Our client's figures from `replay.Record`s (requests with an error left out)."""
    ok = [r for r in records if r.error is None]
    return {"requests": len(records), "completed": len(ok), "output_tokens": sum(len(r.token_ids) for r in ok),
            "ttft_ms": pct([r.ttft_ms for r in ok]), "itl_ms": pct([x for r in ok for x in r.itl_message_ms]),
            "tpot_ms": pct([r.tpot_ms for r in ok]), "e2e_ms": pct([r.e2e_ms for r in ok])}


def peer_records(records) -> dict:
    """The peer's records (`peer_aiperf.PeerRecord`) with our percentiles."""
    ok = [r for r in records if r.error is None]
    return {"requests": len(records), "completed": len(ok),
            "output_tokens": sum(r.output_tokens or 0 for r in ok),
            "ttft_ms": pct([r.ttft_ms for r in ok]), "itl_ms": pct([x for r in ok for x in r.itl_message_ms]),
            "tpot_ms": pct([r.tpot_ms for r in ok]), "e2e_ms": pct([r.e2e_ms for r in ok])}


def compare(our: dict, peer_summary: dict, peer_recs: dict, tolerance: float = TOLERANCE) -> dict:
    """Per figure and statistic: ours, the peer's (its summary; its records where the summary lacks
    it), peer / ours, and whether that is within `tolerance`; `beyond`: those that are not."""
    table: dict = {}
    beyond = []
    for fig in FIGURES:
        table[fig] = {}
        for s in STATS:
            a = (our.get(fig) or {}).get(s)
            b = (peer_summary.get(fig) or {}).get(s)
            b = b if b is not None else (peer_recs.get(fig) or {}).get(s)
            ratio = round(b / a, 3) if a and b is not None else None
            within = ratio is not None and abs(ratio - 1.0) <= tolerance
            table[fig][s] = {"ours": a, "peer": None if b is None else round(b, 2), "ratio": ratio, "within": within,
                             "peer_records": (peer_recs.get(fig) or {}).get(s)}
            if not within:
                beyond.append(f"{fig} {s}")
    return {"tolerance": tolerance, "figures": table, "beyond": beyond, "agree": not beyond}


def markdown(result: dict) -> str:
    def f(x, d=1):
        return "-" if x is None else f"{x:,.{d}f}"

    cmp_ = result["comparison"]
    peer = result["peer"]["name"]
    lines = [f"| figure | ours p50 / p99 (ms) | {peer} p50 / p99 (ms) | {peer} / ours p50 / p99 | "
             f"{peer}'s records, our percentiles p50 / p99 |", "|---|---|---|---|---|"]
    names = {"ttft_ms": "TTFT", "itl_ms": "ITL (per message)", "tpot_ms": "TPOT"}
    for fig in FIGURES:
        row = cmp_["figures"][fig]
        flag = {s: "" if row[s]["within"] else " (!)" for s in STATS}
        lines.append(f"| {names[fig]} | {f(row['p50']['ours'])} / {f(row['p99']['ours'])} | {f(row['p50']['peer'])} / "
                     f"{f(row['p99']['peer'])} | {f(row['p50']['ratio'], 3)}{flag['p50']} / "
                     f"{f(row['p99']['ratio'], 3)}{flag['p99']} | {f(row['p50']['peer_records'])} / "
                     f"{f(row['p99']['peer_records'])} |")
    o, p = result["ours"], result["peer"]["records"]
    lines += ["", f"- requests completed: ours {o['completed']}/{o['requests']}, {peer} {p['completed']}/"
                  f"{p['requests']}; output tokens: ours {o['output_tokens']}, {peer} {p['output_tokens']}",
              f"- within {cmp_['tolerance']:.0%}: {'all' if cmp_['agree'] else 'no: ' + ', '.join(cmp_['beyond'])}"]
    return "\n".join(lines)
