"""The router's event loop (issue 17, defect 9): text decoded incrementally, O(batch) per batch;
stop strings found across batch boundaries with a bounded scan, and never partly sent;
incomplete UTF-8 held back; a large prompt tokenized on a worker thread. The router's real
`stream.Output` on a real `Request`, fed batches the way RLD's stream does."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from serving.pb import cluster_pb2, common_pb2
from serving.router.detok import IncrementalText
from serving.router.metrics import RouterMetrics
from serving.router.request import Request
from serving.router.request_state import State
from serving.router.stream import Output


class ByteTokenizer:
    """Token id = one UTF-8 byte (a character may span several tokens, as with byte-level BPE);
    counts the tokens it is asked to decode."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special: bool = False) -> str:
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


def run_output(token_batches, stop_strings=(), tok=None):
    """-> (text the user got, finish reason, tokenizer, messages) for RLD's batches through Output."""
    tok = tok or ByteTokenizer()

    async def main():
        r = Request()
        r.pipeline = common_pb2.PIPELINE_PD_LOCAL
        for state in (State.ADMISSION, State.PLAN, State.RESERVE, State.RELAY_STREAMING):
            r.advance(state)  # RLD is the source

        async def relay():  # one batch per message, as a stream that the user keeps up with
            pos = 0
            for i, ids in enumerate(token_batches):
                last = i == len(token_batches) - 1
                r.relay_out.put_nowait(cluster_pb2.TokenBatch(
                    start_position=pos, token_ids=ids,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED))
                pos += len(ids)
                await asyncio.sleep(0)

        out = Output(r, tok, stop_strings, RouterMetrics())
        feeder = asyncio.create_task(relay())
        text, finish, messages = "", None, 0
        async for msg in out.messages():
            text += msg.text
            finish = msg.finish_reason or finish
            messages += 1
        feeder.cancel()
        return text, finish, messages

    text, finish, messages = asyncio.run(main())
    return text, finish, tok, messages


def one_token_batches(text: str) -> list[list[int]]:
    return [[b] for b in text.encode()]


TEXT = "Grüße aus Zürich — 東京 and back: 🙂 done. " * 40  # multi-byte characters split over tokens


def test_text_is_the_whole_decode_and_costs_linear_tokenizer_work():
    text, finish, tok, messages = run_output(one_token_batches(TEXT))
    n = len(TEXT.encode())
    assert messages > n // 2  # the batches came one by one, not merged into one message
    assert text == TEXT and finish == common_pb2.FINISH_REASON_LENGTH
    # Re-decoding everything per batch costs n^2/2 (~2.2 M tokens here); the window ~4n.
    print(f"tokens decoded for {n} one-token batches: {tok.decoded}")
    assert tok.decoded <= 6 * n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batch_sizes_give_the_same_text(seed):
    data = TEXT.encode()
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, len(data), 60).tolist()))
    batches = [list(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)])]
    assert run_output(batches)[0] == TEXT


def test_a_stop_string_spanning_batches_ends_the_text_before_it():
    text, finish, _, _ = run_output(one_token_batches(TEXT), stop_strings=["Tokyo", "東京 and"])
    assert text == TEXT[:TEXT.index("東京 and")]
    assert finish == common_pb2.FINISH_REASON_STOP


def test_the_stop_scan_is_bounded_by_the_new_text_and_the_longest_stop():
    it = IncrementalText(ByteTokenizer(), ["x" * 256, "needle"])
    tokens: list[int] = []
    for _ in range(2000):
        tokens += list(b"abcdefgh")
        it.add(tokens)
        assert it.pending == ""  # nothing of "abcdefgh" can start a stop string
    tokens += list(b"..need")
    assert it.add(tokens) == ("..", False)  # "need" may be the start of "needle": held back
    assert it.pending == "need"
    tokens += list(b"le!")
    assert it.add(tokens) == ("", True)


def test_text_that_only_looks_like_a_stop_string_start_is_sent_at_the_end():
    text, finish, _, _ = run_output(one_token_batches("the end is nee"), stop_strings=["needle"])
    assert text == "the end is nee" and finish == common_pb2.FINISH_REASON_LENGTH


def test_invalid_bytes_are_not_held_forever():
    bad = [[0xF0], [0x9F]] + [[0x41]] * 20  # a truncated 4-byte sequence, then plain text
    text = run_output(bad)[0]
    assert text.endswith("A" * 20)


@pytest.mark.real_model
def test_the_real_tokenizer_streams_the_same_text_as_one_decode():
    from pddjax.model.meta import model_facts

    _, tok = model_facts("smollm2-135m")
    text = "Hello, wörld! 東京で 🙂 ok.\n  Indented  code:\tx = 42  # done " * 8
    ids = tok.encode(text)
    batches = [b for b in (ids[i:i + 3] for i in range(0, len(ids), 3)) if b]
    got = run_output([[t] for t in ids], tok=tok)[0]
    assert got == tok.decode(ids, skip_special=True)
    assert run_output(batches, tok=tok)[0] == tok.decode(ids, skip_special=True)


class SlowTokenizer:
    """Tokenizes like a huge prompt would: seconds of CPU (here a blocking sleep)."""

    def encode(self, text: str) -> list[int]:
        time.sleep(0.5)
        return [1, 2, 3]


def test_a_large_prompt_is_tokenized_off_the_event_loop():
    from pddjax.model.config import TINY
    from serving.pb import router_pb2
    from serving.router import validate

    async def main():
        ticks = 0

        async def other_streams():  # what every other request's stream needs: the loop turning
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(other_streams())
        await asyncio.sleep(0)
        req = router_pb2.GenerateRequest(text="x" * (validate.OFF_LOOP_CHARS + 1), max_tokens=4)
        r = Request()
        await validate.read(r, req, TINY, SlowTokenizer(), "chunked")
        ticker.cancel()
        return r.prompt, ticks

    prompt, ticks = asyncio.run(main())
    assert prompt == [1, 2, 3]
    assert ticks >= 20  # the loop kept turning during the 0.5 s of tokenizing
