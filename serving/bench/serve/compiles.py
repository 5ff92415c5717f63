"""Step compiles an engine service made after it reported SERVING, read from its Prometheus
/metrics (the URL is in its ready file): the gauge `pddjax_jit_compiles_after_ready` when the
service exports it, else the difference of `pddjax_jit_compiles` (jitted step and KV copy
variants built in the process) between the moment the stack reported ready and the end of the
mode. The engine thread refreshes those gauges at most 4 times a second and whenever it goes
idle; before its first command it has not refreshed them yet, so the reading at ready is 0 and
the difference also counts compiles made while loading (none today: nothing compiles before
the first request). A compile on the serving path is seconds on a CPU: a user sees it as a
stall (a long TTFT, or a gap in the stream)."""

from __future__ import annotations

import time
import urllib.request

AFTER_READY = "pddjax_jit_compiles_after_ready"
COMPILES = "pddjax_jit_compiles"
PENDING = "pddjax_jit_background_pending"  # step shapes a service ([engine] ready = "cover") still builds


def parse(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value}; samples of one name (label sets) summed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line.split(" ", 1)[0]:
            name, rest = line.split("{", 1)
            rest = rest.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        value = rest.split()
        try:
            out[name] = out.get(name, 0.0) + float(value[0])
        except (IndexError, ValueError):
            continue
    return out


def scrape(url: str | None, timeout: float = 5.0) -> dict[str, float] | None:
    """One service's metrics, or None when it cannot be read."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def read(urls: dict[str, str | None]) -> dict[str, dict[str, float]]:
    """{role: {AFTER_READY, COMPILES: value (those the service exports)}} for each engine service."""
    out: dict[str, dict[str, float]] = {}
    for role, url in urls.items():
        got = scrape(url) or {}
        out[role] = {k: got[k] for k in (AFTER_READY, COMPILES) if k in got}
    return out


def after_ready(at_ready: dict[str, dict], at_end: dict[str, dict]) -> dict:
    """Per service and in total: {"per_service": {role: n | None}, "total": n | None,
    "source": {role: "gauge" | "difference" | "missing"}}; the total is None when no service
    could be read, else the sum over the services that could."""
    per, source = {}, {}
    for role, end in at_end.items():
        start = at_ready.get(role, {})
        if AFTER_READY in end:
            per[role], source[role] = int(round(end[AFTER_READY])), "gauge"
        elif COMPILES in end and COMPILES in start:
            per[role], source[role] = max(0, int(round(end[COMPILES] - start[COMPILES]))), "difference"
        else:
            per[role], source[role] = None, "missing"
    known = [v for v in per.values() if v is not None]
    return {"per_service": per, "total": sum(known) if known else None, "source": source}


def during(before: dict[str, dict], after: dict[str, dict]) -> dict[str, int | None]:
    """`pddjax_jit_compiles` made between two readings, per service (the measured phase's)."""
    return {role: (max(0, int(round(a[COMPILES] - before.get(role, {})[COMPILES])))
                   if COMPILES in a and COMPILES in before.get(role, {}) else None)
            for role, a in after.items()}


def wait_built(urls: dict[str, str | None], timeout: float = 600.0) -> float:
    """Wait until no engine service has step shapes left to build in the background (its
    `pddjax_jit_background_pending` gauge 0, or absent: a service that built all before SERVING)
    -> seconds waited. Measurements of a steady state start after it: a background compile
    shares the cores with the steps. TimeoutError (one sentence) past `timeout`."""
    t0 = time.monotonic()
    while True:
        left = {role: (scrape(url) or {}).get(PENDING, 0) for role, url in urls.items() if url}
        if not any(left.values()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"services still building step shapes after {timeout:.0f} s: "
                               + ", ".join(f"{r} {int(n)} left" for r, n in left.items() if n))
        time.sleep(0.2)
