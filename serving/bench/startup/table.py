"""The text of `pddjax bench startup`: one line per start as it finishes, then a table of every
start (healthy, first token) and, per service, where its start went."""

from __future__ import annotations

PHASES = ("jax_s", "weights_s", "engine_s", "shapes_s", "kv_copies_s")  # a service's own phases, in order
JAX = ("trace_s", "lower_s", "xla_compile_s", "cache_read_s", "cache_hits", "cache_misses")


def run_line(run: dict) -> str:
    return (f"startup: ready={run['ready']} {run['cache']}: healthy {run['healthy_s']:.1f} s, first token "
            f"{run['first_token_s']:.1f} s, {run['tokens']} tokens by {run['done_s']:.1f} s")


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def render(figures: dict) -> str:
    runs = figures["runs"]
    out = [f"pddjax bench startup, model {figures['model']} ({figures.get('cpus')} CPUs)", "",
           f"{'ready':<6} {'cache':<5} {'healthy s':>10} {'first token s':>14} {'done s':>7}"]
    for r in runs:
        out.append(f"{r['ready']:<6} {r['cache']:<5} {r['healthy_s']:>10.1f} {r['first_token_s']:>14.1f} "
                   f"{r['done_s']:>7.1f}")
    cols = ("shapes", *PHASES, "total_s", *JAX, "background_total")
    out += ["", "per service (seconds unless a count; shapes = step shapes built before SERVING):",
            f"{'ready':<6} {'cache':<5} {'role':<8} " + " ".join(f"{c.removesuffix('_s'):>10}" for c in cols)]
    for r in runs:
        for role, s in sorted(r["services"].items()):
            out.append(f"{r['ready']:<6} {r['cache']:<5} {role:<8} " + " ".join(f"{_cell(s.get(c)):>10}" for c in cols))
    return "\n".join(out)
