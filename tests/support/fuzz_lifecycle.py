"""Request lifecycles for the serving fuzz (tests/serving/test_fuzz.py): a script of one or two
requests' RPCs across P, RLD and MD on the same ids, each step with a pause before the next.

A script is (spec, [(step, pause s)]); a step is a tuple naming the RPC and its fuzzed values
(`step_call` turns it into (service, method, message)). Steps: reserve on RLD or MD (the
spec, or another one), prefill on P (targets among RLD and MD with fuzzed start, role and
first-token flag, chunk size), decode, handoff (RLD to MD, or to itself), handoff tokens,
push (junk KV chunks, on a PushKV or a PushKVStream), calls (reserve / release / handoff tokens
as calls on one Calls stream, with cancels and junk calls), hold (pause / resume), release
(cache, cancel), info. Placeholders ("@0", "@main", ...) as in tests/support/fuzz_messages.py.
PD_LOCAL, PD_CROSS and PDD are the router's own flows, as scripts.
"""

from __future__ import annotations

from hypothesis import strategies as st

from serving.call_link import METHODS
from serving.pb import cluster_pb2, common_pb2
from tests.support.fuzz_messages import VOCAB, message, mostly, samplings, token_lists, u32

ROLES = ["prefill", "relay", "main"]
_CALL_FIELD = {method: field for field, method in METHODS.items()}  # Decode method -> CallRequest's field
specs = st.builds(lambda prompt, max_tokens, sampling, stops: cluster_pb2.SequenceSpec(
    request_id="@0", prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop_token_ids=stops),
    mostly(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24), token_lists),
    mostly(st.integers(1, 8), u32), samplings, st.lists(st.integers(0, VOCAB - 1), max_size=2))
rids = st.sampled_from(["@0", "@0", "@0", "@1"])
tiers = st.sampled_from(["relay", "main"])
steps = st.one_of(
    st.tuples(st.just("reserve"), tiers, rids, st.booleans(), st.one_of(st.none(), specs)),
    st.tuples(st.just("prefill"), rids, st.lists(st.tuples(tiers, st.one_of(st.integers(0, 30), u32), st.booleans(),
                                                            st.integers(0, 4)), max_size=2),
              st.one_of(st.just(0), st.integers(1, 5000)), st.one_of(st.none(), specs)),
    st.tuples(st.just("decode"), tiers, rids),
    st.tuples(st.just("handoff"), rids, st.integers(0, 3), u32, st.sampled_from(["@main", "@main", "@relay"])),
    st.tuples(st.just("tokens"), tiers, rids, st.one_of(st.integers(0, 12), u32), token_lists, st.booleans(),
              st.one_of(st.integers(0, 3), u32)),
    st.tuples(st.just("push"), tiers, st.lists(message(cluster_pb2.KVChunk.DESCRIPTOR), max_size=3)),
    st.tuples(st.just("pushstream"), tiers, st.lists(message(cluster_pb2.KVStreamRequest.DESCRIPTOR), max_size=4)),
    st.tuples(st.just("calls"), tiers, st.lists(st.one_of(
        st.tuples(st.just("reserve"), st.just("@"), rids, st.booleans(), st.one_of(st.none(), specs)),
        st.tuples(st.just("release"), st.just("@"), rids, st.booleans(), st.booleans()),
        st.tuples(st.just("tokens"), st.just("@"), rids, st.one_of(st.integers(0, 12), u32), token_lists,
                  st.booleans(), st.one_of(st.integers(0, 3), u32)),
        st.tuples(st.just("cancel"), st.integers(0, 5)),
        message(cluster_pb2.CallRequest.DESCRIPTOR)), max_size=4)),
    st.tuples(st.just("hold"), tiers, rids, st.booleans()),
    st.tuples(st.just("release"), st.sampled_from(ROLES), rids, st.booleans(), st.booleans()),
    st.tuples(st.just("info"), st.sampled_from(ROLES)))
lifecycles = st.tuples(specs, st.lists(st.tuples(steps, st.sampled_from([0.0, 0.0, 0.05, 0.3])), min_size=1,
                                       max_size=8))

CANONICAL = cluster_pb2.SequenceSpec(request_id="@0", prompt=list(range(5, 25)), max_tokens=8)
_R, _M = common_pb2.ROLE_RELAY, common_pb2.ROLE_MAIN
PD_LOCAL = [(("reserve", "relay", "@0", False, None), 0.3), (("decode", "relay", "@0"), 0.05),
            (("prefill", "@0", [("relay", 0, True, _R)], 0, None), 0.0)]
PD_CROSS = [(("reserve", "main", "@0", True, None), 0.3), (("decode", "main", "@0"), 0.05),
            (("prefill", "@0", [("main", 0, True, _M)], 0, None), 0.0)]
PDD = [(("reserve", "main", "@0", True, None), 0.0), (("reserve", "relay", "@0", False, None), 0.3),
       (("decode", "relay", "@0"), 0.0), (("decode", "main", "@0"), 0.05),
       (("prefill", "@0", [("relay", 0, True, _R), ("main", 0, False, _M)], 0, None), 0.3)]


def _spec(base, variant, rid):
    s = cluster_pb2.SequenceSpec()
    s.CopyFrom(variant if variant is not None else base)
    s.request_id = rid
    return s


def step_call(spec, step) -> tuple[str, str, object]:
    """(service, method, message or chunks) of one lifecycle step; placeholders not bound yet."""
    kind, *a = step
    if kind == "reserve":
        role, rid, use_cache, variant = a
        return role, "Reserve", cluster_pb2.ReserveRequest(spec=_spec(spec, variant, rid), use_cache=use_cache)
    if kind == "prefill":
        rid, targets, chunk_bytes, variant = a
        return "prefill", "Prefill", cluster_pb2.PrefillRequest(
            spec=_spec(spec, variant, rid), chunk_bytes=chunk_bytes,
            targets=[cluster_pb2.KVTarget(address=f"@{tier}", start=start, include_first_token=first, role=role)
                     for tier, start, first, role in targets])
    if kind == "decode":
        return a[0], "Decode", cluster_pb2.DecodeRequest(request_id=a[1])
    if kind == "handoff":
        rid, mode, threshold, address = a
        return "relay", "Handoff", cluster_pb2.HandoffRequest(request_id=rid, main_address=address, mode=mode,
                                                              threshold=threshold)
    if kind == "tokens":
        role, rid, start, toks, final, chunk_seq = a
        return role, "HandoffTokens", cluster_pb2.HandoffTokensRequest(
            request_id=rid, start_position=start, token_ids=toks, final=final, chunk_seq=chunk_seq)
    if kind == "push":
        return a[0], "PushKV", a[1]
    if kind == "pushstream":
        return a[0], "PushKVStream", a[1]
    if kind == "calls":  # lifecycle steps as calls on one Calls stream (ids 1, 2, ...), cancels, junk
        role, inner = a
        out = []
        for i, item in enumerate(inner, 1):
            if isinstance(item, cluster_pb2.CallRequest):
                out.append(item)
            elif item[0] == "cancel":
                out.append(cluster_pb2.CallRequest(id=item[1], cancel=True))
            else:
                _, method, msg = step_call(spec, item)
                out.append(cluster_pb2.CallRequest(id=i, timeout_s=5.0, **{_CALL_FIELD[method]: msg}))
        return role, "Calls", out
    if kind == "hold":
        role, rid, on = a
        return role, "Hold", cluster_pb2.HoldRequest(request_id=rid, hold=on)
    if kind == "release":
        role, rid, cache, cancel = a
        return role, "Release", cluster_pb2.ReleaseRequest(request_id=rid, cache=cache, cancel=cancel)
    return a[0], "Info", cluster_pb2.InfoRequest()
