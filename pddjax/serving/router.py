"""The router: the user-facing streaming `Generate`, running any pipeline on request.

A request's life (pipeline pdd; the others drop a tier):
  1. tokenize and validate (INVALID_ARGUMENT with one sentence, nothing reserved);
  2. auto: ask MD's DRC how much of the prompt it holds (chained page hashes) and pick
     pd-cross (high hit), pd-local (low hit, very short output) or pdd (the rule is simple
     here; the router issue makes it good);
  3. Reserve on MD (pins its DRC prefix -> cached_on_main) and on RLD; open their Decode streams;
  4. P.Prefill with targets RLD (from 0, with the first token) and MD (from cached_on_main):
     P pushes both at once; RLD starts streaming tokens (relay) as soon as its KV lands;
  5. when P reports MD's KV delivered, RLD.Handoff: RLD hands MD the token IDs and its stream
     ends with handed_off_at = N; MD's stream starts at N (main) -> no gap, duplicate or reorder;
  6. finish: every tier is released (idempotent), cancelled on client disconnect.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from pddjax.kv.page_hash import chain_hashes
from pddjax.serving import rpc
from pddjax.serving.config import RouterSettings
from pddjax.serving.decode_service import validate_spec
from pddjax.serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc

P = common_pb2
PIPELINE_NAMES = {P.PIPELINE_AUTO: "auto", P.PIPELINE_PDD: "pdd", P.PIPELINE_PD_CROSS: "pd-cross",
                  P.PIPELINE_PD_LOCAL: "pd-local"}


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _from_rpc(e: grpc.aio.AioRpcError, who: str) -> _Abort:
    return _Abort(e.code(), e.details() or f"{who} failed with {e.code().name}")


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, settings: RouterSettings, model_config, tokenizer):
        self.s, self.cfg, self.tok = settings, model_config, tokenizer
        self._bg: set[asyncio.Task] = set()
        self._md_page_size: int | None = None

    def start(self, loop) -> None:
        self.p = cluster_pb2_grpc.PrefillStub(rpc.channel(self.s.prefill))
        self.rld = cluster_pb2_grpc.DecodeStub(rpc.channel(self.s.relay))
        self.md = cluster_pb2_grpc.DecodeStub(rpc.channel(self.s.main))

    # ---- request parsing ---------------------------------------------------------------
    def _prompt(self, req) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind == "token_ids":
            return list(req.token_ids.ids)
        if kind is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt")
        if self.tok is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"model {self.cfg.name} has no tokenizer: send token_ids")
        if kind == "text":
            return self.tok.encode(req.text) if req.text else []
        msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        if not msgs:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the chat has no messages")
        try:
            return self.tok.encode(self.tok.apply_chat_template(msgs))
        except Exception as e:  # noqa: BLE001  (template errors are the user's)
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot render the chat: {e}") from None

    async def _choose(self, prompt, max_tokens) -> tuple[int, str]:
        if self._md_page_size is None:
            self._md_page_size = (await self.md.Info(cluster_pb2.InfoRequest())).page_size
        S = self._md_page_size
        m = await self.md.MatchPrefix(cluster_pb2.MatchPrefixRequest(page_size=S, page_hashes=chain_hashes(prompt, S)))
        frac = m.matched_tokens / len(prompt)
        why = f"MD holds {m.matched_tokens}/{len(prompt)} prompt tokens ({frac:.0%})"
        if frac >= self.s.auto_hit_fraction:
            return P.PIPELINE_PD_CROSS, why + f" >= {self.s.auto_hit_fraction:.0%}: pd-cross"
        if max_tokens <= self.s.auto_local_max_tokens:
            return P.PIPELINE_PD_LOCAL, why + f", output <= {self.s.auto_local_max_tokens} tokens: pd-local"
        return P.PIPELINE_PDD, why + ": pdd"

    # ---- Generate ----------------------------------------------------------------------
    async def Generate(self, request, context):
        try:
            async for msg in self._generate(request):
                yield msg
        except _Abort as e:
            await context.abort(e.code, e.message)

    async def _generate(self, req):
        t0 = time.perf_counter()
        prompt = self._prompt(req)
        params = rpc.sampling_from_pb(req.sampling)
        max_tokens = int(req.max_tokens)
        rid = req.request_id or uuid.uuid4().hex
        err = validate_spec(self.cfg, rid, prompt, params, max_tokens)
        if err:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if req.pipeline not in PIPELINE_NAMES:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pipeline {req.pipeline}")
        bad = [t for t in req.stop_token_ids if t >= self.cfg.vocab_size]
        if bad:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"stop token id {bad[0]} is outside the vocabulary")
        stop_ids = tuple(() if req.ignore_eos else self.cfg.eos_token_ids) + tuple(req.stop_token_ids)
        mode = req.handoff or (P.HANDOFF_MODE_CHUNKED if self.s.handoff == "chunked" else P.HANDOFF_MODE_ONE_SHOT)
        pipeline, explain = req.pipeline, ""
        try:
            if pipeline == P.PIPELINE_AUTO:
                pipeline, explain = await self._choose(prompt, max_tokens)
        except grpc.aio.AioRpcError as e:
            raise _from_rpc(e, "main") from None
        spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(params),
                                        max_tokens=max_tokens, stop_token_ids=stop_ids)
        use_rld = pipeline in (P.PIPELINE_PDD, P.PIPELINE_PD_LOCAL)
        use_md = pipeline in (P.PIPELINE_PDD, P.PIPELINE_PD_CROSS)
        yield router_pb2.GenerateResponse(request_id=rid, pipeline=pipeline, prompt_token_ids=prompt, explain=explain)

        st = _State()
        relay_q: asyncio.Queue = asyncio.Queue()
        main_q: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        try:
            try:
                if use_md:
                    st.cached_md = (await self.md.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True))).cached_tokens
                if use_rld:
                    await self.rld.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True))
            except grpc.aio.AioRpcError as e:
                raise _from_rpc(e, "reserve") from None
            if use_rld:
                tasks.append(asyncio.create_task(_pump(self.rld.Decode(cluster_pb2.DecodeRequest(request_id=rid)), relay_q, "relay")))
            if use_md:
                tasks.append(asyncio.create_task(_pump(self.md.Decode(cluster_pb2.DecodeRequest(request_id=rid)), main_q, "main")))
            targets = []
            if use_rld:
                targets.append(cluster_pb2.KVTarget(address=self.s.relay, start=0, role=P.ROLE_RELAY, include_first_token=True))
            if use_md:
                targets.append(cluster_pb2.KVTarget(address=self.s.main_wan or self.s.main, start=st.cached_md,
                                                    role=P.ROLE_MAIN, include_first_token=not use_rld))
            preq = cluster_pb2.PrefillRequest(spec=spec, targets=targets, chunk_bytes=self.s.chunk_bytes)
            tasks.append(asyncio.create_task(self._prefill(rid, preq, pipeline, mode, st, relay_q, main_q, tasks)))

            current, source = (relay_q, P.ROLE_RELAY) if use_rld else (main_q, P.ROLE_MAIN)
            tokens, sources, text, finish = [], [], "", P.FINISH_REASON_UNSPECIFIED
            while not finish:
                items = [await current.get()]
                while not current.empty() and not _terminal(items[-1]):
                    items.append(current.get_nowait())
                new, switch = [], False
                for it in items:
                    if isinstance(it, _Abort):
                        raise it
                    if it.token_ids and it.start_position != len(tokens) + len(new):
                        raise _Abort(grpc.StatusCode.INTERNAL, f"token stream out of order at position {it.start_position}")
                    new += it.token_ids
                    switch = switch or it.handed_off
                    finish = finish or it.finish_reason
                if not new and not finish:
                    if switch:
                        current, source, st.handoff_at = main_q, P.ROLE_MAIN, len(tokens)
                    continue
                if st.ttft is None and new:
                    st.ttft = time.perf_counter() - t0
                tokens += new
                sources += [source] * len(new)
                delta, text, hit = self._text(tokens, text, req.stop_strings)
                if hit:
                    finish = P.FINISH_REASON_STOP
                msg = router_pb2.GenerateResponse(request_id=rid, token_ids=new, sources=[source] * len(new), text=delta)
                if finish:
                    msg.finish_reason = finish
                    msg.usage.CopyFrom(router_pb2.Usage(
                        prompt_tokens=len(prompt), cached_on_prefill=st.cached_p, cached_on_main=st.cached_md,
                        completion_tokens=len(tokens), relay_tokens=sources.count(P.ROLE_RELAY),
                        main_tokens=sources.count(P.ROLE_MAIN), kv_bytes_to_relay=st.bytes_rld,
                        kv_bytes_to_main=st.bytes_md, handoff_tokens=st.handoff_tokens,
                        handoff_chunks=st.handoff_chunks))
                    msg.timings.CopyFrom(router_pb2.Timings(
                        ttft_ms=1e3 * (st.ttft or 0), total_ms=1e3 * (time.perf_counter() - t0), prefill_ms=st.prefill_ms,
                        kv_to_main_ms=st.md_ms, handoff_position=st.handoff_at or 0))
                yield msg
                if switch:
                    current, source, st.handoff_at = main_q, P.ROLE_MAIN, len(tokens)
        finally:
            for t in tasks:
                t.cancel()
            task = asyncio.create_task(self._release(rid, use_rld, use_md))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    def _text(self, tokens, text, stop_strings) -> tuple[str, str, bool]:
        if self.tok is None:
            return "", "", False
        full = self.tok.decode(tokens, skip_special=True)
        if full.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            return "", text, False
        for s in stop_strings:
            i = full.find(s, max(0, len(text) - len(s)))
            if s and i >= 0:
                return full[len(text):i], full[:i], True
        return full[len(text):], full, False

    async def _prefill(self, rid, preq, pipeline, mode, st, relay_q, main_q, tasks):
        try:
            async for ev in self.p.Prefill(preq):
                if ev.HasField("prefilled"):
                    st.cached_p, st.prefill_ms = ev.prefilled.num_cached, ev.prefilled.prefill_ms
                    continue
                d = ev.transfer_done
                err = _Abort(_CODES.get(d.code, grpc.StatusCode.UNKNOWN), d.error) if d.code else None
                if d.role == P.ROLE_RELAY:
                    st.bytes_rld = d.bytes
                    if err:
                        relay_q.put_nowait(err)
                    continue
                st.bytes_md, st.md_ms = d.bytes, d.ms
                if err and pipeline == P.PIPELINE_PD_CROSS:
                    main_q.put_nowait(err)
                elif err and d.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
                    relay_q.put_nowait(err)  # MD refuses this KV: never decode it anywhere
                elif not err and pipeline == P.PIPELINE_PDD:
                    tasks.append(asyncio.create_task(self._handoff(rid, mode, st)))
        except grpc.aio.AioRpcError as e:
            relay_q.put_nowait(_from_rpc(e, "prefill"))
            main_q.put_nowait(_from_rpc(e, "prefill"))

    async def _handoff(self, rid, mode, st):
        try:
            r = await self.rld.Handoff(cluster_pb2.HandoffRequest(
                request_id=rid, main_address=self.s.main_wan or self.s.main, mode=mode, threshold=self.s.handoff_threshold))
            if r.handed_off:
                st.handoff_tokens, st.handoff_chunks = r.tokens, r.chunks
        except grpc.aio.AioRpcError:
            pass  # RLD keeps decoding and finishes the request itself

    async def _release(self, rid, use_rld, use_md):
        calls = [self.p.Release(cluster_pb2.ReleaseRequest(request_id=rid, cache=True, cancel=True))]
        if use_rld:
            calls.append(self.rld.Release(cluster_pb2.ReleaseRequest(request_id=rid, cache=True, cancel=True)))
        if use_md:
            calls.append(self.md.Release(cluster_pb2.ReleaseRequest(request_id=rid, cache=True, cancel=True)))
        await asyncio.gather(*calls, return_exceptions=True)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _State:
    def __init__(self):
        self.cached_p = self.cached_md = 0
        self.bytes_rld = self.bytes_md = 0
        self.prefill_ms = self.md_ms = 0.0
        self.ttft = None
        self.handoff_at = None
        self.handoff_tokens = self.handoff_chunks = 0


def _terminal(item) -> bool:
    return isinstance(item, _Abort) or bool(item.finish_reason) or item.handed_off


async def _pump(call, q: asyncio.Queue, who: str) -> None:
    try:
        async for batch in call:
            q.put_nowait(batch)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            q.put_nowait(_from_rpc(e, who))
