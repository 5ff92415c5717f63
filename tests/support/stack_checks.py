"""Checks against a running stack: every tier idle (no request, no page, no integrity error), the
engines' `pddjax_kv_pages_active` gauges at zero, one Prometheus gauge or every sample read from a
/metrics URL, the router's Stats; waiting for a condition; a pdd request whose switch to MD is
forced after RLD streamed a given number of tokens."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pddjax.wan.emulator import A_TO_B
from serving.pb import cluster_pb2, cluster_pb2_grpc, router_pb2, router_pb2_grpc


def wait_until(pred, timeout: float, what: str) -> None:
    """Poll `pred` until it holds; fail after `timeout` seconds, saying `what` did not happen."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def assert_idle(stack, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        infos = {}
        for role in ("prefill", "relay", "main"):
            ch = grpc.insecure_channel(stack.addr[role])
            stub = (cluster_pb2_grpc.PrefillStub if role == "prefill" else cluster_pb2_grpc.DecodeStub)(ch)
            infos[role] = stub.Info(cluster_pb2.InfoRequest(), timeout=10)
            ch.close()
        assert not any(i.integrity_error for i in infos.values()), infos
        if all(i.requests == 0 and i.pages_active == 0 for i in infos.values()):
            return
        assert time.monotonic() < deadline, {r: (i.requests, i.pages_active) for r, i in infos.items()}
        time.sleep(0.2)


def pages_active_gauge(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pddjax_kv_pages_active "))


def assert_gauges_zero(stack, timeout: float) -> None:
    """`pddjax_kv_pages_active` on every engine service's /metrics reads 0 (polled: the gauge is
    refreshed by the engine thread)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = {c.role: pages_active_gauge(c.metrics) for c in stack.children if c.role != "router"}
        if len(gauges) == 3 and not any(gauges.values()):
            return
        assert time.monotonic() < deadline, gauges
        time.sleep(0.2)


def gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in {url}")


def scrape(url: str) -> dict:
    """{(sample name, sorted label items): value} from a /metrics URL."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def router_stats(address: str) -> dict:
    """The router's Stats (instances, links, counters, admission) at its gRPC `address`."""
    with grpc.insecure_channel(address) as ch:
        return json.loads(router_pb2_grpc.RouterStub(ch).Stats(router_pb2.StatsRequest(), timeout=10).json)


def generate_switching_after(stack, client, req, tokens: int):
    """Generate with MD's KV held on the A -> B link (blackholed: held, not lost) until RLD has
    streamed `tokens`: then it lands, and the stream moves to MD a few tokens later."""
    emulator, seen = stack.link.link.emulator, [0]

    def on_tokens(msg):
        seen[0] += len(msg.token_ids)
        if seen[0] >= tokens:
            emulator.clear_faults()

    emulator.inject(A_TO_B, blackhole=True)
    try:
        return client.generate(req, timeout=240, on_tokens=on_tokens)
    finally:
        emulator.clear_faults()
