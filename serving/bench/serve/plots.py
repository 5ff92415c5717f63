"""PNG plots of `pddjax bench serve`'s JSON: TTFT CDF per mode, WAN bytes per mode, and the
trace's prefix-hit histogram (ideal, and what MD's DRC really held in `pdd`). matplotlib is
imported lazily (the `plots` extra)."""

from __future__ import annotations

import os

from pddjax.errors import UserError


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plots needs matplotlib: pip install 'pddjax[plots]'") from None
    return plt


def plot(result: dict, folder: str) -> list[str]:
    """Write ttft_cdf.png, wan_bytes.png, hit_hist.png into `folder`; returns their paths."""
    plt = require_matplotlib()
    os.makedirs(folder, exist_ok=True)
    reqs, paths = result.get("requests", {}), []

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rows in reqs.items():
        xs = sorted(r["ttft_ms"] for r in rows if r["ttft_ms"] is not None)
        if xs:
            ax.step([x / 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=mode)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per mode")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, plt, folder, "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(result["modes"])
    vals = [result["modes"][m]["wan_bytes"] / 1e6 for m in names]
    ax.bar(names, vals, color="tab:blue")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    ax.set_ylabel("WAN bytes A -> B (MB)")
    ax.set_title("WAN traffic per mode")
    paths.append(_save(fig, plt, folder, "wan_bytes.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = reqs.get("pdd") or next(iter(reqs.values()), [])
    bins = [i / 20 for i in range(21)]
    ax.hist([r["hit"] for r in rows], bins=bins, alpha=0.6, label="trace (ideal)")
    md = [r["cached_on_main"] / r["prompt_tokens"] for r in rows if r["prompt_tokens"]]
    if md:
        ax.hist(md, bins=bins, alpha=0.6, label="MD's DRC (pdd)")
    ax.set_xlabel("prefix-hit rate")
    ax.set_ylabel("requests")
    ax.set_title("Prefix-hit distribution")
    ax.legend()
    paths.append(_save(fig, plt, folder, "hit_hist.png"))
    return paths


def _save(fig, plt, folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
