"""The trace: one record per request, and its JSONL file format (read and write).

File format (`.jsonl`, UTF-8, one JSON object per line):

    {"format": "pddjax-trace", "version": 1, "config": {...}}        <- optional header
    {"request_id": "s3-t0", "session_id": 3, "turn": 0, "arrival_s": 1.25, ...}
    ...

Request fields (all required except `kind`):

- `request_id`     "s{session_id}-t{turn}"
- `session_id`     session index; a session's turns share one context
- `turn`           0-based turn index within the session
- `arrival_s`      turn 0: send time. Turn n > 0: scheduled send time, assuming the previous
                   turn took its nominal latency. Replay (simulator and benchmark) sends turn n
                   at max(arrival_s, last token of turn n-1 + think_s): open loop for a fast
                   enough system, closed loop for a slower one. Negative arrival_s marks
                   *history* (sessions already in progress at t=0, `warm_start_s`): the
                   simulator loads those turns into its caches instead of serving them; a
                   benchmark may replay them unmeasured to warm caches, or skip them.
- `think_s`        tool / user time between turn n-1's last token and turn n's send (0 for turn 0)
- `doc_id`, `doc_tokens`  the shared long context the session started from, and its length
- `context_seed`   seeds the session's token ids (see `pddjax.workload.tokens`)
- `prefix_tokens`  leading prompt tokens equal to the *source sequence*: for turn 0 the doc,
                   for turn n the previous turn's prompt followed by its output
- `new_tokens`     prompt tokens after the prefix; prompt_tokens = prefix_tokens + new_tokens
- `prompt_tokens`
- `output_tokens`  tokens the turn emits; replay forces this length (ignore EOS)
- `max_tokens`     equal to output_tokens
- `kind`           "start" (turn 0), "append" (whole previous sequence kept) or "edit"

The ideal prefix-hit rate of a request is prefix_tokens / prompt_tokens; what a cache really
hits depends on what it still holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = "pddjax-trace"
VERSION = 1


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (fields documented in the module docstring)."""

    request_id: str
    session_id: int
    turn: int
    arrival_s: float
    think_s: float
    doc_id: int
    doc_tokens: int
    context_seed: int
    prefix_tokens: int
    new_tokens: int
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    kind: str = "append"

    @property
    def hit(self) -> float:
        """Ideal prefix-hit rate: prefix_tokens / prompt_tokens."""
        return self.prefix_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def check(self) -> None:
        """Raise ValueError if the record is internally inconsistent."""
        if self.prefix_tokens + self.new_tokens != self.prompt_tokens:
            raise ValueError(f"{self.request_id}: prefix_tokens + new_tokens != prompt_tokens")
        if min(self.prefix_tokens, self.new_tokens, self.output_tokens, self.turn) < 0:
            raise ValueError(f"{self.request_id}: negative count")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"{self.request_id}: prompt and output need at least one token")
        if self.turn == 0 and self.prefix_tokens > self.doc_tokens:
            raise ValueError(f"{self.request_id}: turn 0 prefix longer than its doc")


_FIELDS = [f for f in TraceRequest.__dataclass_fields__]


def write_trace(path: str | Path, requests: list[TraceRequest], config: dict | None = None) -> None:
    """Write `requests` as JSONL with a header line (config may be None)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"format": FORMAT, "version": VERSION, "config": config or {}}) + "\n")
        for r in requests:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace (header optional), check every record, sort by arrival.

    Raises ValueError naming the line for malformed input.
    """
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {lineno}: not JSON ({e.msg})") from None
            if obj.get("format") == FORMAT:
                if obj.get("version") != VERSION:
                    raise ValueError(f"line {lineno}: unsupported trace version {obj.get('version')}")
                continue
            missing = [k for k in _FIELDS if k not in obj and k != "kind"]
            if missing:
                raise ValueError(f"line {lineno}: missing fields {', '.join(missing)}")
            try:
                req = TraceRequest(**{k: obj[k] for k in _FIELDS if k in obj})
                req.check()
            except (TypeError, ValueError) as e:
                raise ValueError(f"line {lineno}: {e}") from None
            out.append(req)
    out.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn))
    return out


def summarize(requests: list[TraceRequest]) -> dict:
    """Headline statistics of a trace: counts, mean hit, share above 95%, tokens."""
    n = len(requests)
    if n == 0:
        return {"requests": 0}
    hits = sorted(r.hit for r in requests)
    return {
        "requests": n,
        "sessions": len({r.session_id for r in requests}),
        "mean_hit": sum(hits) / n,
        "share_hit_above_95": sum(h > 0.95 for h in hits) / n,
        "share_hit_below_50": sum(h < 0.5 for h in hits) / n,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in requests) / n,
        "mean_output_tokens": sum(r.output_tokens for r in requests) / n,
        "span_s": requests[-1].arrival_s - requests[0].arrival_s,
    }
