"""`pddjax bench startup`'s parts that need no stack: a service's startup report (its phases and
JAX's compile events, counted in this process) and the table drawn from a run's figures."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pddjax.engines import startup_clock
from pddjax.model.jax_setup import configure
from serving.bench.startup import table


def test_the_report_holds_the_phases_and_the_compiles_made_inside_them():
    configure()
    startup_clock.install()
    before = startup_clock.jax_totals()
    clock = startup_clock.StartupClock()
    with clock.phase("shapes_s"):
        jax.jit(lambda x: x * 3 + 1).lower(jnp.zeros((7, 13))).compile()
    rep = clock.report(shapes=1)
    assert rep["shapes"] == 1 and rep["shapes_s"] > 0 and rep["total_s"] >= rep["shapes_s"]
    assert rep["imports_s"] > 0  # this process's age when the clock started
    assert rep["lower_s"] > before["lower_s"] and rep["backend_s"] > before["backend_s"]
    assert rep["cache_hits"] + rep["cache_misses"] >= before["cache_hits"] + before["cache_misses"]
    assert set(startup_clock.DURATIONS.values()) | set(startup_clock.COUNTS.values()) | {"xla_compile_s"} <= set(rep)


def test_the_table_names_every_start_and_every_service():
    svc = {"shapes": 7, "stated": 110, "weights_s": 2.5, "shapes_s": 3.7, "total_s": 15.0, "cache_hits": 49,
           "background_total": 103}
    figures = {"model": "smollm2-135m", "cpus": 2, "runs": [
        {"ready": "cover", "cache": "cold", "healthy_s": 51.4, "first_token_s": 60.8, "done_s": 64.0, "tokens": 32,
         "services": {"main": svc, "router": {"total_s": 6.3}}},
        {"ready": "all", "cache": "warm", "healthy_s": 52.9, "first_token_s": 53.1, "done_s": 54.1, "tokens": 32,
         "services": {"main": {**svc, "shapes": 110, "background_total": 0}}}]}
    text = table.render(figures)
    assert "cover  cold        51.4           60.8    64.0" in text
    assert "all    warm        52.9           53.1    54.1" in text
    rows = [line for line in text.splitlines() if line.startswith(("cover  cold  main", "all    warm  main"))]
    assert len(rows) == 2 and "103" in rows[0] and " 110 " in rows[1] + " "
    line = table.run_line(figures["runs"][0])
    assert "router" in text and line.startswith("startup: ready=cover cold: healthy 51.4 s")
