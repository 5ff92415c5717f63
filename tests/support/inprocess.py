"""Helpers for tests that drive a real Decode service in this process (tiny model): a gRPC
context whose abort raises `Refused`, an async iterator of chunks, a slot's stream read to its
finish, and P's side of a request (prefill a prompt on a PagedEngine and export its KV in the
canonical form)."""

from __future__ import annotations

import asyncio

from pddjax.engines.paged_engine import EngineConfig, PagedEngine

SMALL = EngineConfig(page_size=16, num_pages=64, max_step_tokens=64, max_rows=4, attention="xla")


class Refused(Exception):
    """What `Ctx.abort` raises: the status code and sentence a servicer aborted with."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code, self.message = code, message


class Ctx:
    """The servicer context of an in-process call: `abort` raises Refused."""

    async def abort(self, code, message):
        raise Refused(code, message)


async def aiter(items):
    for x in items:
        yield x


async def slot_tokens(slot, timeout: float = 30) -> list[int]:
    """A slot's stream read to its finish -> every token id it carried."""
    got = []
    while True:
        batch = await asyncio.wait_for(slot.out.get(), timeout)
        got += list(batch.token_ids)
        if batch.finish_reason:
            return got


def engine(tiny, cfg: EngineConfig = SMALL) -> PagedEngine:
    return PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)


def prefill_runs(tiny, prompts: dict, params, cfg: EngineConfig = SMALL) -> dict:
    """P's side: each prompt prefilled, its KV exported (request id -> KVRun)."""
    p = engine(tiny, cfg)
    runs = {}
    for k, prompt in prompts.items():
        p.add(k, prompt, params, 1, (), hold_on_finish=True)
        while p.seqs[k].pages.num_tokens < len(prompt):
            p.step()
        runs[k] = p.export_kv(k, 0, len(prompt))
    return runs
