"""`pddjax bench serving`'s figures (command.py runs the bursts): one burst's figures
from the client's per-stream records, the router's /metrics read before and after a burst
(page waits, refusals), the ratios, and the markdown table.

Per burst (client side, perf_counter): tokens_per_s = output tokens / (last token of any stream -
the moment the streams were started); TTFT = started -> first token; ITL = gaps between
token-carrying messages of a stream, a message of k tokens counting k gaps of gap/k; as vLLM's
benchmark defines them, `message_itl_ms` = the gaps between a stream's streamed messages (one per
message, whatever it holds) and `tpot_ms` = per stream (e2e - TTFT) / (n - 1) over its n output
tokens; tokens_per_message = output tokens / token-carrying messages; max_gap = the longest gap
between two messages of one stream; e2e = started -> last token; exact = output tokens equal to
the monolithic reference's for every stream.
"""

from __future__ import annotations

import dataclasses

from serving.bench.serve.figures import pct

PAGE_WAIT = "pddjax_router_page_wait_seconds"


@dataclasses.dataclass
class Stream:
    tokens: list[int] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)  # arrival of each token-carrying message
    sizes: list[int] = dataclasses.field(default_factory=list)  # tokens in that message
    main_tokens: int = 0
    error: str | None = None  # gRPC code name: details


def burst_figures(t0: float, recs: list[Stream], refs: list[list[int]]) -> dict:
    ok = [r for r in recs if r.error is None and r.times]
    itl, gaps, message_itl, tpot = [], [], [], []
    for r in ok:
        for a, b, k in zip(r.times, r.times[1:], r.sizes[1:]):
            itl += [1e3 * (b - a) / k] * k
            message_itl.append(1e3 * (b - a))
        if len(r.tokens) > 1:
            tpot.append(1e3 * (r.times[-1] - r.times[0]) / (len(r.tokens) - 1))
        gaps.append(max((1e3 * (b - a) for a, b in zip(r.times, r.times[1:])), default=0.0))
    end = max((r.times[-1] for r in ok), default=t0)
    out_tokens = sum(len(r.tokens) for r in ok)
    mismatched = [i for i, (r, ref) in enumerate(zip(recs, refs)) if r.error is None and r.tokens != ref]
    diverged = [[i, next((k for k, (a, b) in enumerate(zip(recs[i].tokens, refs[i])) if a != b),
                         min(len(recs[i].tokens), len(refs[i])))] for i in mismatched[:8]]
    errors: dict[str, int] = {}
    for r in recs:
        if r.error:
            code = r.error.split(":", 1)[0]
            errors[code] = errors.get(code, 0) + 1
    return {"streams": len(recs), "completed": len(ok), "errors": errors,
            "first_error": next((r.error for r in recs if r.error), None),
            "output_tokens": out_tokens, "wall_s": round(end - t0, 3),
            "tokens_per_s": round(out_tokens / (end - t0), 1) if end > t0 else None,
            "ttft_ms": pct([1e3 * (r.times[0] - t0) for r in ok]), "itl_ms": pct(itl),
            "message_itl_ms": pct(message_itl), "tpot_ms": pct(tpot),
            "max_gap_ms": pct(gaps), "e2e_ms": pct([1e3 * (r.times[-1] - t0) for r in ok]),
            "tokens_per_message": round(out_tokens / max(1, sum(len(r.sizes) for r in ok)), 2),
            "main_token_share": round(sum(r.main_tokens for r in ok) / out_tokens, 4) if out_tokens else 0.0,
            "exact": not mismatched and len(ok) == len(recs), "mismatched": mismatched[:8],
            "diverged_at": diverged}  # [[request, first differing output position]]


TIE_MARGIN = 1e-4  # logits: a top-1 / top-2 gap this small flips with the order of a float32 sum


def explain_mismatches(fig: dict, model, prompts: list[list[int]]) -> None:
    """For each mismatched stream: the reference's top-1 minus top-2 logit at the position where
    it diverged -> fig["mismatch_margins"] [[request, position, margin]] and fig["near_ties"] (how
    many diverged at a margin < TIE_MARGIN: a batched step sums in another order than the dense
    reference, so an exact float tie can go either way; any other mismatch is a bug)."""
    if not fig.get("diverged_at"):
        return
    import numpy as np

    from pddjax.engines.reference import ReferenceEngine
    from pddjax.model.sampling_params import GREEDY

    ref, margins = ReferenceEngine(model.config, model.weights), []
    for i, pos in fig["diverged_at"]:
        for k, (_, logits) in enumerate(ref.stream(prompts[i], GREEDY, pos + 1, stop_ids=(), return_logits=True)):
            if k == pos:
                top = np.sort(logits)[-2:]  # [2]
                margins.append([i, pos, float(top[1] - top[0])])
    fig["mismatch_margins"] = margins
    fig["near_ties"] = sum(m < TIE_MARGIN for _, _, m in margins)


def exact_label(f: dict) -> str:
    ties = f" ({f['near_ties']} at a near-tie)" if f.get("near_ties") else ""
    return f"{f['exact']}{ties}"


def scrape_router(url: str | None) -> dict:
    """{"page_wait": {tier: {"count", "sum", "buckets": {le: cumulative}}}, "failures": {code: n},
    "handoffs": {"chunked" | "one-shot" | "given up, skipped" | "given up, stopped": n}}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"page_wait": {}, "failures": {}, "handoffs": {}}
    if not url:
        return out
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode("utf-8", "replace")
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(PAGE_WAIT):
                t = out["page_wait"].setdefault(s.labels.get("tier", "?"), {"count": 0.0, "sum": 0.0, "buckets": {}})
                if s.name.endswith("_bucket"):
                    t["buckets"][s.labels["le"]] = s.value
                elif s.name.endswith("_count"):
                    t["count"] = s.value
                elif s.name.endswith("_sum"):
                    t["sum"] = s.value
            elif s.name == "pddjax_router_failures_total":
                code = s.labels.get("code", "?")
                out["failures"][code] = out["failures"].get(code, 0) + s.value
            elif s.name in ("pddjax_router_handoffs_total", "pddjax_router_main_given_up_total"):
                key = s.labels.get("mode") or "given up, " + s.labels.get("when", "?")
                out["handoffs"][key] = s.value
    return out


def page_wait_delta(before: dict, after: dict) -> dict:
    """Per tier over one burst: observations, how many waited > 1 ms, mean and bucket-bound p50/p99 (s)."""
    out = {}
    for tier, a in after["page_wait"].items():
        b = before["page_wait"].get(tier, {"count": 0.0, "sum": 0.0, "buckets": {}})
        n = a["count"] - b["count"]
        cum = sorted(((float(le), v - b["buckets"].get(le, 0.0)) for le, v in a["buckets"].items()))
        first = cum[0][1] if cum else n

        def bound(q, cum=cum, n=n):
            return next((le for le, c in cum if c >= q * n), None) if n else None
        out[tier] = {"count": int(n), "waited": int(n - first), "mean_s": round((a["sum"] - b["sum"]) / n, 4) if n
                     else None, "p50_le_s": bound(0.5), "p99_le_s": bound(0.99),
                     "buckets": {str(le): int(c) for le, c in cum}}
    return out


def counts_delta(before: dict, after: dict, key: str) -> dict:
    """What each count of `scrape_router`'s `key` ("failures", "handoffs") grew by between two scrapes."""
    return {k: int(v - before[key].get(k, 0)) for k, v in after[key].items() if v - before[key].get(k, 0) > 0}


def failures_delta(before: dict, after: dict) -> dict:
    return counts_delta(before, after, "failures")


def cpu_delta(before: dict, after: dict) -> dict:
    return {k: round(after[k] - before[k], 2) for k in after if k in before}


def per_token(cpu_s: dict, tokens: int) -> dict:
    """CPU microseconds per output token of each service (and the bench client) over a burst."""
    return {k: round(1e6 * v / tokens, 1) for k, v in cpu_s.items()} if tokens else {}


def ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def _pp(d: dict) -> str:
    return f"{d['p50']:.0f} / {d['p99']:.0f}" if d.get("p50") is not None else "-"


def _p2(d: dict | None) -> str:
    return f"{d['p50']:.2f} / {d['p99']:.2f}" if d and d.get("p50") is not None else "-"


def markdown(res: dict) -> str:
    lines = ["| pipeline | streams | tok/s | engine decode tok/s | serving/engine | TTFT p50/p99 ms | ITL p50/p99 ms |"
             " ITL/msg p50/p99 ms | TPOT p50/p99 ms | max gap ms | e2e p50/p99 ms | exact | tok/msg |",
             "|" + "---|" * 13]
    for p, per in res["serving"].items():
        for n, f in per.items():
            e = res["engine"][n.split("@")[0]]["decode_tokens_per_s"]
            itl = f"{f['itl_ms']['p50']} / {f['itl_ms']['p99']}"
            lines.append(f"| {p} | {n} | {f['tokens_per_s']} | {e} | {res['ratios'][p][n]} | {_pp(f['ttft_ms'])} | "
                         f"{itl} | {_p2(f.get('message_itl_ms'))} | {_p2(f.get('tpot_ms'))} | "
                         f"{f['max_gap_ms']['max']} | {_pp(f['e2e_ms'])} | "
                         f"{exact_label(f)} ({f['completed']}/{f['streams']}) | {f['tokens_per_message']} |")
    if "pdd_over_pd_local" in res["ratios"]:
        lines.append(f"\npdd / pd-local tokens/s: {res['ratios']['pdd_over_pd_local']}")
    lines += ["", "CPU us per output token (the engine alone: 1e6 / its decode tok/s):"]
    for p, per in res["serving"].items():
        for n, f in per.items():
            us = ", ".join(f"{k} {v}" for k, v in f.get("cpu_us_per_token", {}).items())
            alone = res["engine"][n.split("@")[0]]["decode_tokens_per_s"]
            handoffs = "".join(f"; {k} {v}" for k, v in f.get("handoffs", {}).items())
            share = f"; MD's token share {f['main_token_share']}" if p == "pdd" else ""
            lines.append(f"- {p} x {n}: {us}; engine alone {round(1e6 / alone, 1) if alone else '-'}{share}{handoffs}")
    if res["burst"]:
        lines += ["", "| burst | pipeline | tokens | completed | exact | refused | TTFT p50/p99 ms | e2e p50/p99 ms | "
                  "page waits (waited/count, mean s) |", "|" + "---|" * 9]
        for p, per in res["burst"].items():
            for n, f in per.items():
                waits = ", ".join(f"{t} {w['waited']}/{w['count']} {w['mean_s']}" for t, w in f["page_wait"].items())
                lines.append(f"| {n} | {p} | {f['max_tokens']} | {f['completed']}/{f['streams']} | {exact_label(f)} | "
                             f"{f['refused']} | {_pp(f['ttft_ms'])} | {_pp(f['e2e_ms'])} | {waits or '-'} |")
    lines.append(f"\nload average before / after: {res['load_avg']['before']} / {res['load_avg'].get('after')}")
    return "\n".join(lines)
