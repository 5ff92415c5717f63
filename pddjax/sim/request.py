"""A request's state inside the simulator, and the record the metrics are computed from.

Times are simulation seconds. `first_token` and `finish` are when the user sees the first
and last token (tokens decoded in datacenter B arrive one WAN latency later than decoded).
"""

from __future__ import annotations

from pddjax.workload.trace import TraceRequest


class SimRequest:
    __slots__ = (
        "tr", "rid", "sid", "turn", "doc", "prompt", "prefix", "output",
        "arrival", "prefill_start", "prefill_end", "p_predicted_s", "p_hit", "p_inst",
        "pipeline", "md_hit", "md_pinned", "md_pinned_turn", "md_inst", "md_seq", "rld_inst", "rld_seq",
        "transfer", "wan_bytes", "kv_at_md", "handed", "chunks", "handoff_start", "handoff_end",
        "first_token", "finish", "rld_tokens", "md_tokens", "done",
        "streams", "sync", "sync_main", "rld_last", "hit_forced", "md_committed",
    )

    def __init__(self, tr: TraceRequest):
        self.tr, self.rid, self.sid, self.turn = tr, tr.request_id, tr.session_id, tr.turn
        self.doc, self.prompt = tr.doc_id, tr.prompt_tokens
        self.prefix, self.output = tr.prefix_tokens, tr.output_tokens
        self.arrival = self.prefill_start = self.prefill_end = -1.0
        self.p_predicted_s = 0.0
        self.p_hit = self.md_hit = self.md_pinned = 0
        self.md_pinned_turn = -1
        self.p_inst = self.md_inst = self.md_seq = self.rld_inst = self.rld_seq = self.transfer = None
        self.pipeline = ""
        self.wan_bytes = 0.0
        self.kv_at_md = False
        self.handed = self.chunks = 0
        self.handoff_start = self.handoff_end = -1.0
        self.first_token = self.finish = -1.0
        self.rld_tokens = self.md_tokens = 0
        self.done = False
        self.streams: list = []  # KVStream per target of P's KV
        self.sync = False  # a background context push to MD, not a user request
        self.sync_main = False  # filtered turn: push its context to MD afterwards
        self.rld_last = -1.0  # when RLD emitted its last token for this request
        self.hit_forced: int | None = None  # P hit given by the caller (a sync: P holds the prompt)
        self.md_committed = 0  # MD pool tokens Reserve set aside while the KV is on its way (host)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs)."""
        return (self.finish - self.first_token) / (self.output - 1) if self.output > 1 else 0.0

    def record(self) -> dict:
        """Flat, JSON-friendly record of the finished request."""
        return {
            "request_id": self.rid, "session_id": self.sid, "turn": self.turn, "arrival_s": self.arrival,
            "pipeline": self.pipeline, "prompt": self.prompt, "output": self.output,
            "ideal_hit": self.prefix / self.prompt, "p_hit": self.p_hit / self.prompt,
            "md_hit": self.md_hit / self.prompt, "ttft_s": self.ttft, "tpot_s": self.tpot,
            "prefill_start_s": self.prefill_start, "prefill_end_s": self.prefill_end,
            "first_token_s": self.first_token, "finish_s": self.finish, "wan_bytes": self.wan_bytes,
            "rld_tokens": self.rld_tokens, "md_tokens": self.md_tokens, "chunks": self.chunks,
            "handoff_s": (self.handoff_end - self.handoff_start) if self.handoff_end >= 0 else None,
            "p_hit_tokens": self.p_hit, "md_hit_tokens": self.md_hit,
        }
