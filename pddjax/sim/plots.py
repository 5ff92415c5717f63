"""PNG figures of the paper scenario. matplotlib is optional and imported only here."""

from __future__ import annotations

from pathlib import Path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def paper_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """Write bathtub.png, drift.png, ttft.png, bcr.png into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("bathtub", "extend chunks batched"), ("bathtub_unbatched_tail_chunks", "not batched")):
        xs, ys = zip(*result[key])
        ax[0].plot(xs, ys, marker="o", label=label)
    ax[0].set(xlabel="mean prefix-hit rate", ylabel="BCR (requests per USD)", title="SLA-meeting BCR")
    ax[0].legend()
    xs, ys = zip(*result["bathtub_revenue"])
    ax[1].plot(xs, [y / 1e6 for y in ys], marker="o", color="C2")
    ax[1].set(xlabel="mean prefix-hit rate", ylabel="billed value per USD (M token-units)",
              title="revenue view (cached input 0.1x, output 4x)")
    paths.append(_save(fig, out / "bathtub.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style in (("normal", "-"), ("rld_normal_path", "--")):
        rows = result["drift"][key]["timeline"]
        ax.plot([r[0] for r in rows], [r[1] for r in rows], style, marker="o", label=f"MD hit ({key})")
    rows = result["drift"]["normal"]["timeline"]
    ax.plot([r[0] for r in rows], [r[2] for r in rows], ":", color="gray", label="P hit")
    ax.set(xlabel="time (s)", ylabel="token-weighted hit rate", title="drift: P-RLD as a normal path")
    ax.legend()
    paths.append(_save(fig, out / "drift.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    lines = result["ttft_vs_cross_by_line_gbps"]
    keys = sorted(lines, key=float)
    for mode, style in (("pdd", "-o"), ("pd-cross", "--s")):
        ax.plot([float(k) for k in keys], [lines[k][mode]["p99"] / 1e3 for k in keys], style, label=f"{mode} P99")
        ax.plot([float(k) for k in keys], [lines[k][mode]["p50"] / 1e3 for k in keys], style, alpha=0.4,
                label=f"{mode} P50")
    ax.set_xscale("log")
    ax.set(xlabel="line bandwidth (Gb/s)", ylabel="TTFT (s)",
           title=f"TTFT at {lines[keys[0]]['rps']:.2f} req/s")
    ax.legend()
    paths.append(_save(fig, out / "ttft.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["baseline", "pdd"]
    ax.bar(names, [result["bcr"][n] for n in names], color=["C0", "C1"])
    ax.set(ylabel="BCR (requests per USD)", title=f"BCR gain {100 * result['bcr_gain']:+.1f}%")
    paths.append(_save(fig, out / "bcr.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
