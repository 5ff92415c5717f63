"""Fuzzing every RPC of P, RLD and MD and the router's Generate (issues 8 and 17), over a real
tiny stack (P, RLD, MD and the router as processes); messages from tests/support/fuzz_messages.py.

  - every method of P, RLD and MD: fuzzed well-formed messages and raw malformed bytes;
  - request lifecycles on RLD and MD: Reserve, Prefill (P pushing real KV), PushKV of junk
    chunks, Decode, Handoff, HandoffTokens, Release, Info, MatchPrefix in a fuzzed order on
    the same ids, with fuzzed and out-of-range values (the canonical pd-local, pd-cross and
    pdd flows among them);
  - the router's Generate, every public field: token ids in and out of the vocabulary, texts
    and chats (refused: tiny has no tokenizer), sampling values with NaN, infinities and huge
    numbers, request and session ids, stop strings and ids, max_tokens, pipelines, handoff
    modes. An OK answer must be token-identical to the monolithic reference;
  - Generate with texts and chats on a router with the real model's tokenizer and chat
    template (fake full peers, tests/support/fake_peers.py): special-token text, template syntax.

Every fuzzed call must end, with OK or a status in ALLOWED, within CALL_SECONDS of its start
(its client deadline) and RELEASE_SECONDS after its example released its ids (a Decode stream
on a reserved id waits for KV by design; releasing the id ends it). ALLOWED are the statuses
that refuse bad input or state on purpose, each with a sentence: INVALID_ARGUMENT,
OUT_OF_RANGE, NOT_FOUND, FAILED_PRECONDITION, ALREADY_EXISTS, RESOURCE_EXHAUSTED,
PERMISSION_DENIED, plus DATA_LOSS (a KV chunk that fails its crc or sequence checks) and
ABORTED (an id this service released). Generate, the public call, is held to PUBLIC: the
user's input (INVALID_ARGUMENT, OUT_OF_RANGE, PERMISSION_DENIED) or the deployment's capacity
(RESOURCE_EXHAUSTED); a tier's NOT_FOUND, ALREADY_EXISTS, ABORTED... reaching a user is a
defect (3: shared client ids). Never DEADLINE_EXCEEDED (a hang, or an engine wedged by an
earlier call), UNAVAILABLE (a crashed, wedged or draining peer), CANCELLED, UNKNOWN or INTERNAL
(an unhandled exception), UNIMPLEMENTED. Example counts and the seed are fixed (hypothesis
`derandomize`, no database, no shrinking): the same calls every run.

Afterwards (the last test): every process alive and SERVING, integrity intact, 0 requests and
0 pages on every pool (Info and the pddjax_kv_pages_active gauge) within IDLE_SECONDS, each
service's RSS at most RSS_GROWTH_MB above its value after the warm-up, and a normal request
on every pipeline token-exact."""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.client import Client, make_request
from serving.pb import cluster_pb2, common_pb2, router_pb2
from tests.support.fake_peers import FakePeers
from tests.support.fuzz_lifecycle import CANONICAL, PD_CROSS, PD_LOCAL, PDD, lifecycles, step_call
from tests.support.fuzz_messages import CLASSES, VALID, Calls, bind, generate_requests, message, text_requests
from tests.support.serving_stack import Stack
from tests.support.stack_checks import assert_gauges_zero, assert_idle
from tools.soak import rss_mb

pytestmark = pytest.mark.timeout(900)
STACK = {"model": "tiny", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 128, "max_step_tokens": 64, "max_rows": 4},
         "router": {"chunk_bytes": 4096}}
ALLOWED = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION", "ALREADY_EXISTS",
           "RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "DATA_LOSS", "ABORTED"}
# Generate: the user's input or the deployment's capacity only; NOT_FOUND, ALREADY_EXISTS, ABORTED,
# DATA_LOSS or FAILED_PRECONDITION there would be the tiers' internal state reaching a user
PUBLIC = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED"}
CALL_SECONDS = 15.0  # every fuzzed call's client deadline: reaching it (DEADLINE_EXCEEDED) is a hang
SETTLE_SECONDS = 1.0  # an example's calls may end on their own this long; then its ids are released
RELEASE_SECONDS = 5.0  # ... and every call still running must end within this
IDLE_SECONDS = 15.0  # every pool idle after the fuzz (well below the 60 s reservation lease)
RSS_GROWTH_MB = 32.0  # per service, after the fuzz against after the warm-up (measured: +0-2 MB)
SERVICES = {"prefill": cluster_pb2.DESCRIPTOR.services_by_name["Prefill"],
            "relay": cluster_pb2.DESCRIPTOR.services_by_name["Decode"],
            "main": cluster_pb2.DESCRIPTOR.services_by_name["Decode"]}
_fresh = itertools.count()


def fixed(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))


def check(outcomes) -> None:
    for what, code, details, seconds in outcomes:
        assert code == "OK" or code in ALLOWED, f"{what} ended {code} after {seconds:.1f} s: {details}"


class Fuzz:
    """The stack, a channel per service, the calls' threads and the figures after the warm-up."""

    def __init__(self, stack: Stack, ref: ReferenceEngine):
        self.stack, self.ref = stack, ref
        self.channels = {role: grpc.insecure_channel(stack.addr[role]) for role in (*SERVICES, "router")}
        self.pool = concurrent.futures.ThreadPoolExecutor(32)
        self.normal_requests()
        self.rss = self.rss_now()

    def rss_now(self) -> dict:
        return {c.role: rss_mb(c.proc.pid) for c in self.stack.children}

    def normal_requests(self) -> None:
        c = Client(self.stack.addr["router"])
        try:
            for i, pipeline in enumerate(("pdd", "pd-cross", "pd-local", "auto")):
                p = list(range(3 + i, 40 + i))
                got = c.generate(make_request(p, max_tokens=12, pipeline=pipeline, ignore_eos=True), timeout=60)
                assert got.token_ids == self.ref.generate(p, SamplingParams(), 12, ()).token_ids, pipeline
        finally:
            c.close()

    def ids(self) -> dict:
        n = next(_fresh)
        return {"@0": f"fz{n}a", "@1": f"fz{n}b", "@relay": self.stack.addr["relay"],
                "@main": self.stack.addr["main"]}

    def calls(self) -> Calls:
        return Calls(self.pool, CALL_SECONDS)

    def start(self, calls: Calls, role: str, method: str, payload, raw=False) -> None:
        m = SERVICES[role].methods_by_name[method]
        calls.start(f"{role}.{method}", self.channels[role], f"/{SERVICES[role].full_name}/{method}", payload,
                    CLASSES[m.output_type.full_name], m.client_streaming, m.server_streaming, raw)

    def finish(self, calls: Calls, ids: dict) -> None:
        """Lets the example's calls end on their own, releases its ids on every tier, checks every call."""
        calls.wait(SETTLE_SECONDS)
        release = self.calls()
        for role in SERVICES:
            for rid in (ids["@0"], ids["@1"], "x" * 300, "bad\x00id\n"):
                self.start(release, role, "Release", cluster_pb2.ReleaseRequest(request_id=rid, cancel=True))
        outcomes = release.outcomes(RELEASE_SECONDS)
        assert all(code == "OK" for _, code, _, _ in outcomes), outcomes
        check(calls.outcomes(RELEASE_SECONDS))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for ch in self.channels.values():
            ch.close()


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory, tiny):
    stack = Stack(STACK, str(tmp_path_factory.mktemp("fuzz")), use_link=False)
    try:
        f = Fuzz(stack, ReferenceEngine(tiny.config, tiny.weights))
        yield f
        f.close()
    finally:
        stack.close()


# ---- every method of P, RLD and MD ------------------------------------------------------
def _inputs(method):
    one = message(method.input_type)
    if method.client_streaming:
        return st.tuples(st.lists(one, max_size=3), st.just(False)) | \
            st.tuples(st.lists(st.binary(max_size=80), max_size=3), st.just(True))
    return st.tuples(one, st.just(False)) | st.tuples(st.binary(max_size=80), st.just(True))


@pytest.mark.parametrize("role,method_name", [(r, m.name) for r, svc in SERVICES.items() for m in svc.methods])
def test_fuzz_rpc(fuzz, role, method_name):
    method = SERVICES[role].methods_by_name[method_name]

    @fixed(25)
    @given(data=_inputs(method))
    def one(data):
        payload, raw = data
        ids, calls = fuzz.ids(), fuzz.calls()
        if not raw:
            for m in payload if method.client_streaming else [payload]:
                bind(m, ids)
        fuzz.start(calls, role, method_name, payload, raw)
        fuzz.finish(calls, ids)

    one()


# ---- request lifecycles on RLD and MD ------------------------------------------------------
def test_fuzz_request_lifecycles(fuzz):
    """Fuzzed sequences of one or two requests' RPCs across P, RLD and MD, each call started
    in order (its own thread; the drawn pause between starts), the canonical flows first."""

    @fixed(50)
    @example(data=(CANONICAL, PD_LOCAL))
    @example(data=(CANONICAL, PD_CROSS))
    @example(data=(CANONICAL, PDD + [(("handoff", "@0", common_pb2.HANDOFF_MODE_CHUNKED, 4, "@main"), 0.0)]))
    @example(data=(CANONICAL, PDD + [(("handoff", "@0", common_pb2.HANDOFF_MODE_ONE_SHOT, 4, "@main"), 0.0)]))
    @given(data=lifecycles)
    def one(data):
        spec, script = data
        ids, calls = fuzz.ids(), fuzz.calls()
        for step, pause in script:
            role, method, payload = step_call(spec, step)
            for m in payload if method in ("PushKV", "PushKVStream", "Calls") else [payload]:
                bind(m, ids)
            fuzz.start(calls, role, method, payload)
            time.sleep(pause)
        fuzz.finish(calls, ids)

    one()


# ---- the router's Generate ---------------------------------------------------------------
def _generate(channel, req) -> tuple[str, object, list[int]]:
    """(code name, details, tokens) of one Generate, with the fuzz's client deadline."""
    call = channel.unary_stream("/pddjax.v1.Router/Generate", request_serializer=router_pb2.GenerateRequest.
                                SerializeToString, response_deserializer=router_pb2.GenerateResponse.FromString)
    toks = []
    try:
        for msg in call(req, timeout=CALL_SECONDS):
            toks += msg.token_ids
        return "OK", "", toks
    except grpc.RpcError as e:
        return e.code().name, e.details(), toks


def _edge(**sampling) -> router_pb2.GenerateRequest:
    return make_request(list(range(3, 13)), max_tokens=4, pipeline="pdd", **{"temperature": 1.0, **sampling})


# the values that wedged an engine or passed unchecked before issue 17 (defects 1, 4), always tried
EDGE_SAMPLING = [_edge(top_k=2**31), _edge(top_k=2**32 - 1), _edge(seed=2**31), _edge(seed=2**32 - 1),
                 _edge(temperature=math.nan), _edge(temperature=math.inf), _edge(temperature=1e30),
                 _edge(temperature=-1.0), _edge(top_p=math.nan), _edge(top_p=-math.inf), _edge(top_p=1.5)]


@pytest.mark.parametrize("junk", [None, *VALID])
def test_fuzz_generate(fuzz, tiny, junk):
    """Requests with junk in one field (or none): refused with PUBLIC or served token-exact (the
    reference, stop ids and EOS included), within the bound."""
    def body(req):
        code, details, toks = _generate(fuzz.channels["router"], req)
        assert code == "OK" or code in PUBLIC, (code, details, req)
        if code == "OK":
            stop = (() if req.ignore_eos else tuple(tiny.config.eos_token_ids)) + tuple(req.stop_token_ids)
            want = fuzz.ref.generate(list(req.token_ids.ids), rpc.sampling_from_pb(req.sampling), req.max_tokens,
                                     stop).token_ids
            assert toks == want, req

    one = given(req=generate_requests(junk))(body)
    for req in EDGE_SAMPLING if junk == "sampling" else ():
        one = example(req=req)(one)
    fixed(10)(one)()


@pytest.fixture(scope="module")
def text_router(tmp_path_factory):
    """A router with the real model's tokenizer and chat template, against fake full peers."""
    peers = FakePeers()
    d = str(tmp_path_factory.mktemp("fuzz_text"))
    try:
        with open(f"{d}/router.log", "ab") as log:
            router = peers.router(d, model="smollm2-135m", log=log, wan_probe=False)
        try:
            with grpc.insecure_channel(router.address) as ch:
                yield ch
        finally:
            from serving.stack.up import stop_all
            stop_all([router])
    finally:
        peers.close()


def test_fuzz_generate_texts_and_chats(text_router):
    """Tokenizing and templating any text: refused with a sentence (INVALID_ARGUMENT) or passed
    on to the tiers (here full: RESOURCE_EXHAUSTED), within the bound."""
    @fixed(40)
    @given(req=text_requests)
    def one(req):
        code, details, _ = _generate(text_router, req)
        assert code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"), (code, details, req)

    one()


# ---- afterwards ----------------------------------------------------------------------------
def test_after_the_fuzz_every_pool_idle_rss_flat_requests_exact(fuzz):
    for c in fuzz.stack.children:
        assert c.proc.poll() is None, f"the {c.role} service exited with {c.proc.returncode}"
        with grpc.insecure_channel(c.address) as ch:
            st_ = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert st_.status == health_pb2.HealthCheckResponse.SERVING, c.role
    assert_idle(fuzz.stack, timeout=IDLE_SECONDS)
    assert_gauges_zero(fuzz.stack, timeout=IDLE_SECONDS)
    fuzz.normal_requests()
    rss = fuzz.rss_now()
    print("\nRSS MB after the warm-up -> after the fuzz: " + ", ".join(
        f"{r} {fuzz.rss[r]:.0f} -> {rss[r]:.0f}" for r in rss))
    for role, mb in rss.items():
        assert mb - fuzz.rss[role] <= RSS_GROWTH_MB, (role, fuzz.rss[role], mb)
