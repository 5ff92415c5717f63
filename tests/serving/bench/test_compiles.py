"""`bench serve`'s step compiles after SERVING (`serving.bench.serve.compiles`): the Prometheus text
parsed, a real service registry scraped over HTTP, the gauge preferred over the difference of
`pddjax_jit_compiles`, a service that cannot be read reported as missing."""

from __future__ import annotations

from serving.bench.serve import compiles as bc

TEXT = """# HELP pddjax_jit_compiles jitted step / KV copy variants built in this process
# TYPE pddjax_jit_compiles gauge
pddjax_jit_compiles 7.0
pddjax_rpc_total{code="OK",method="Decode"} 3.0
pddjax_rpc_total{code="OK",method="Info x}"} 2.0
pddjax_rpc_seconds_bucket{le="+Inf",method="Decode"} 3.0
not_a_number abc
"""


def test_parse_prometheus_text():
    got = bc.parse(TEXT)
    assert got["pddjax_jit_compiles"] == 7.0
    assert got["pddjax_rpc_total"] == 5.0  # label sets summed, a '}' inside a label value kept apart
    assert got["pddjax_rpc_seconds_bucket"] == 3.0 and "not_a_number" not in got


def test_scrape_a_service_registry():
    from serving.metrics import ServiceMetrics

    m = ServiceMetrics("relay")
    url = m.serve_http("127.0.0.1", 0)
    m.compiles.set(4)
    got = bc.read({"relay": url})["relay"]
    assert got[bc.COMPILES] == 4.0 and set(got) <= {bc.COMPILES, bc.AFTER_READY}  # the gauge once services export it
    assert bc.scrape(None) is None and bc.scrape("http://127.0.0.1:1/metrics", timeout=1) is None
    assert bc.read({"main": None}) == {"main": {}}


def test_after_ready_gauge_else_difference():
    ready = {"prefill": {bc.COMPILES: 0.0}, "relay": {bc.COMPILES: 2.0}, "main": {bc.COMPILES: 1.0}}
    end = {"prefill": {bc.COMPILES: 5.0, bc.AFTER_READY: 0.0},  # the service's own gauge wins
           "relay": {bc.COMPILES: 6.0}, "main": {}}
    got = bc.after_ready(ready, end)
    assert got == {"per_service": {"prefill": 0, "relay": 4, "main": None}, "total": 4,
                   "source": {"prefill": "gauge", "relay": "difference", "main": "missing"}}
    assert bc.after_ready({}, {"main": {}})["total"] is None
    assert bc.during({"relay": {bc.COMPILES: 6.0}}, {"relay": {bc.COMPILES: 9.0}, "main": {bc.COMPILES: 1.0}}) == \
        {"relay": 3, "main": None}
