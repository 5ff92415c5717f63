"""deploy/grafana/pddjax.json queries only metrics the code exports, with labels they carry.

The metric definitions are read from serving/'s source (every prometheus_client Counter,
Gauge, Histogram, Summary and GaugeMetricFamily built with a literal name), so a renamed or
removed metric fails here; the exposition names follow prometheus_client (a counter `x` is
scraped as `x_total`, a histogram as `x_bucket` / `x_sum` / `x_count`). Labels outside a
metric's own are allowed only from the scrape (the pod's labels, deploy/README.md)."""

from __future__ import annotations

import ast
import json
import os
import re

from tests.support.paths import ROOT

KINDS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
         "GaugeMetricFamily": "gauge", "CounterMetricFamily": "counter", "HistogramMetricFamily": "histogram"}
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created")}
SCRAPE_LABELS = {"app_kubernetes_io_component", "app_kubernetes_io_name", "pddjax_io_cluster", "instance", "job",
                 "pod", "namespace"}
PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "le", "without", "avg", "max", "min", "count"}


def defined_metrics() -> dict[str, set[str]]:
    """Exposed sample name -> its labels, for every metric defined in serving/."""
    out: dict[str, set[str]] = {}
    for d, _, files in os.walk(os.path.join(ROOT, "serving")):
        for name in files:
            if not name.endswith(".py") or "/pb" in d:
                continue
            with open(os.path.join(d, name)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                        in KINDS and node.args and isinstance(node.args[0], ast.Constant)):
                    continue
                kind = KINDS[getattr(node.func, "id", getattr(node.func, "attr", None))]
                labels = node.args[2] if len(node.args) > 2 else next(
                    (k.value for k in node.keywords if k.arg in ("labelnames", "labels")), None)
                names = {e.value for e in labels.elts} if isinstance(labels, ast.List | ast.Tuple) else set()
                base = node.args[0].value
                for suffix in SUFFIXES[kind]:
                    out[base + suffix] = names | ({"le"} if suffix == "_bucket" else set())
    return out


def queries() -> list[str]:
    with open(os.path.join(ROOT, "deploy", "grafana", "pddjax.json")) as f:
        dash = json.load(f)
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_the_code_defines_the_metrics_the_issue_names():
    metrics = defined_metrics()
    for name in ("pddjax_router_ttft_seconds_bucket", "pddjax_router_itl_seconds_bucket", "pddjax_kv_pages_used",
                 "pddjax_router_wan_bytes_total", "pddjax_router_failures_total",
                 "pddjax_router_handoff_gap_seconds_bucket", "pddjax_router_link_mbps"):
        assert name in metrics, name  # the parser found them (it would pass vacuously otherwise)


def test_every_metric_and_label_the_dashboard_queries_exists_in_the_code():
    metrics = defined_metrics()
    exprs = queries()
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\bpddjax_[a-zA-Z0-9_]+", expr))
        assert names, expr
        for n in names:
            assert n in metrics, f"{n} (in {expr!r}) is not a metric the code exports"
        used |= names
        for metric, selector in re.findall(r"\b(pddjax_[a-zA-Z0-9_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([a-zA-Z_]+)\s*(?:=|!=|=~|!~)", selector):
                assert label in metrics[metric] | SCRAPE_LABELS, (metric, label)
        own = set().union(*(metrics[n] for n in names))
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in own | SCRAPE_LABELS, f"label {label} of {expr!r} is on none of {sorted(names)}"
        for legend_label in re.findall(r"\{\{(\w+)\}\}", json.dumps(expr)):
            assert legend_label in own | SCRAPE_LABELS
    print(f"dashboard: {len(exprs)} queries over {len(used)} metrics")
