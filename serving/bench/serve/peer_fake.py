"""A fake OpenAI completions server whose timings are known, to tell the two clients of
`bench serve --peer` apart from the server they measure.

    python -m serving.bench.serve.peer_fake [--port 8011] [--ttft-ms 200] [--itl-ms 50] [--model NAME]

POST /v1/completions streams every request the same way: the first token `ttft_ms` after the
request arrived, then one token a message every `itl_ms` (each message's sleep starts after the
previous message was written), `max_tokens` tokens in all (a stream always runs to its length,
as `ignore_eos` asks), each chunk with its `token_ids` when `return_token_ids` is set, then the
usage chunk when `stream_options.include_usage` is, then `[DONE]`; GET /v1/models lists `model`.
No model runs, so the server's own timings are fixed and every client figure's excess over them
(TTFT over `ttft_ms`, ITL and TPOT over `itl_ms`) is the client's and the loopback's; two
clients on the same fake compare their measurement alone. Not a load test of anything: the
sleeps are asyncio's, whose lateness under CPU contention both clients see alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


def make_app(model: str, ttft_ms: float, itl_ms: float):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(_request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                         "owned_by": "peer_fake"}]})

    async def completions(request: Request):
        t0 = time.perf_counter()
        body = await request.json()
        n = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
        ids = bool(body.get("return_token_ids"))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt = body.get("prompt") or ""
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        rid = f"cmpl-fake-{time.monotonic_ns()}"

        def chunk(k: int | None, finish: str | None = None) -> str:
            choice = {"index": 0, "text": "" if k is None else " the", "logprobs": None, "finish_reason": finish}
            if ids and k is not None:
                choice["token_ids"] = [260]
            return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": int(time.time()),
                                          "model": model, "choices": [choice]}) + "\n\n"

        async def events():
            await asyncio.sleep(max(0.0, t0 + ttft_ms / 1e3 - time.perf_counter()))
            for k in range(n):
                if k:
                    await asyncio.sleep(itl_ms / 1e3)
                yield chunk(k)
            yield chunk(None, "length")
            if usage:
                u = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": int(time.time()),
                                             "model": model, "choices": [], "usage": u}) + "\n\n"
            yield "data: [DONE]\n\n"

        if not body.get("stream"):
            return JSONResponse({"error": {"message": "the fake serves streams only", "type": "invalid_request_error"}},
                                status_code=400)
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def main(argv=None) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ttft-ms", type=float, default=200.0)
    ap.add_argument("--itl-ms", type=float, default=50.0)
    args = ap.parse_args(argv)
    print(f"peer_fake: http://{args.host}:{args.port}/v1 (TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms)",
          flush=True)
    uvicorn.run(make_app(args.model, args.ttft_ms, args.itl_ms), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
