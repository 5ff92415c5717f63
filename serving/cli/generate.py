"""`pddjax generate`: local generation with the monolithic reference engine, or, with
`--router HOST:PORT`, through a running PDD stack (`--pipeline`, `--handoff`).

Prints one JSON object with --json (prompt_ids, token_ids, text, finish_reason, timings; through
a router also `sources` (relay or main per token), `pipeline` and `ttft_ms`); otherwise
streams text to stdout as it is generated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pddjax.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text locally (or through a router)")
    p.add_argument("--model", default="smollm2-135m",
                   help="tiny | smollm2-135m | PATH.gguf | a Hugging Face checkpoint DIR (config.json, *.safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (no BOS added unless the GGUF says add_bos_token, "
                     "or a checkpoint's tokenizer.json post-processor adds one)")
    src.add_argument("--prompt-ids", help="comma-separated token IDs, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-ids", default="", help="extra comma-separated stop token IDs (EOS always stops)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--attention", choices=["xla", "pallas", "native"], default=None,
                   help="run through the paged engine with this attention (default: the monolithic reference)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size of the paged engine (with --attention)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="run the paged engine over N devices (the model must admit N; on CPU N fake devices)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--router", metavar="HOST:PORT", help="generate through a PDD router instead of locally")
    p.add_argument("--pipeline", choices=["auto", "pdd", "pd-cross", "pd-local"], default="auto",
                   help="with --router: the pipeline (default: the router's choice)")
    p.add_argument("--handoff", choices=["one-shot", "chunked"], help="with --router: the RLD -> MD handoff mode")
    p.add_argument("--session-id", default="", help="with --router: the conversation this turn belongs to")
    p.add_argument("--timeout", type=float, default=600.0, help="with --router: seconds before giving up")
    p.set_defaults(func=run)


def parse_ids(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be comma-separated integers, got {text!r}") from None


def prepare(args):
    """Validate flags, load the model, build prompt ids. Returns (model, prompt_ids, params, stop_ids)."""
    from pddjax.model.gguf_meta import GGUFError
    from pddjax.model.registry import CheckpointError, ModelNotFound, load_model
    from pddjax.model.sampling_params import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    try:
        params.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    try:
        model = load_model(args.model)
    except (ModelNotFound, GGUFError, CheckpointError) as e:
        raise UserError(str(e)) from None
    tok, cfg = model.tokenizer, model.config
    if args.prompt is not None:
        if tok is None:
            raise UserError(f"model {args.model} has no tokenizer: pass --prompt-ids")
        if not args.prompt:
            raise UserError("the prompt is empty")
        chat = [{"role": "user", "content": args.prompt}]
        try:  # a chat keeps special-token text typed in the prompt plain (chat_template.encode_chat)
            prompt_ids = tok.encode_chat(chat) if args.chat else tok.encode(args.prompt)
        except ValueError as e:  # no chat template, or the template raised
            raise UserError(f"cannot render the chat: {e}") from None
    else:
        if args.chat:
            raise UserError("--chat needs --prompt text, not --prompt-ids")
        prompt_ids = parse_ids(args.prompt_ids, "--prompt-ids")
        if not prompt_ids:
            raise UserError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    if len(prompt_ids) + args.max_tokens > cfg.max_context:
        raise UserError(f"prompt ({len(prompt_ids)} tokens) plus --max-tokens {args.max_tokens} "
                        f"exceeds the model context of {cfg.max_context}")
    stop_ids = tuple(cfg.eos_token_ids) + tuple(parse_ids(args.stop_ids, "--stop-ids"))
    return model, prompt_ids, params, stop_ids


def run_remote(args: argparse.Namespace) -> int:
    """Client mode: the server tokenizes and validates; its errors come back as one sentence."""
    from serving.client import Client, RouterError, make_request

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.prompt is not None and not args.prompt:
        raise UserError("the prompt is empty")
    ids = parse_ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None
    if args.chat and ids is not None:
        raise UserError("--chat needs --prompt text, not --prompt-ids")
    req = make_request(
        ids, None if args.chat else args.prompt, [{"role": "user", "content": args.prompt}] if args.chat else None,
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        stop_ids=parse_ids(args.stop_ids, "--stop-ids"), pipeline=args.pipeline, handoff=args.handoff,
        session_id=args.session_id)

    def show(msg):
        if not args.json:
            sys.stdout.write(msg.text)
            sys.stdout.flush()

    client = Client(args.router)
    try:
        r = client.generate(req, timeout=args.timeout, on_tokens=show)
    except RouterError as e:
        raise UserError(f"the router answered {e.code.name}: {e}") from None
    finally:
        client.close()
    if args.json:
        out = r.to_json()
        out.pop("messages")
        print(json.dumps(out))
    elif not r.text:
        print(",".join(map(str, r.token_ids)))
    else:
        print()
    return 0


def run(args: argparse.Namespace) -> int:
    if args.router:
        return run_remote(args)
    from pddjax.model.jax_setup import configure

    if args.tensor_parallel < 1:
        raise UserError(f"--tensor-parallel must be at least 1, got {args.tensor_parallel}")
    configure(devices=args.tensor_parallel)
    model, prompt_ids, params, stop_ids = prepare(args)
    if not args.json and model.source != "random":  # what was loaded, how long, peak host memory
        print(f"pddjax: {model.describe()}", file=sys.stderr)
    tok = model.tokenizer
    t0 = time.perf_counter()
    ttft, tokens, printed = None, [], ""
    for t in token_stream(args, model, prompt_ids, params, stop_ids):
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        tokens.append(t)
        if not args.json and tok is not None:
            text = tok.decode(tokens, skip_special=True)
            if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    total = time.perf_counter() - t0
    finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
    if args.json:
        paged = args.attention or args.tensor_parallel > 1
        out = {"model": model.config.name, "engine": f"paged-{args.attention or 'auto'}" if paged else "reference",
               "tensor_parallel": args.tensor_parallel,
               "prompt_ids": prompt_ids, "token_ids": tokens,
               "text": tok.decode(tokens, skip_special=True) if tok else None, "finish_reason": finish,
               "ttft_ms": round(1e3 * ttft, 2), "total_ms": round(1e3 * total, 2),
               "load_s": round(model.load_seconds, 3), "weights_from": model.source, "load_memory": model.memory}
        print(json.dumps(out))
    elif tok is None:
        print(",".join(map(str, tokens)))
    else:
        print()
    return 0


def token_stream(args, model, prompt_ids, params, stop_ids):
    """Token ids as they are generated: the monolithic reference, or with --attention (or
    --tensor-parallel N > 1) the paged engine (one sequence through continuous batching)."""
    if args.attention is None and args.tensor_parallel == 1:
        from pddjax.engines.reference import ReferenceEngine

        yield from ReferenceEngine(model.config, model.weights, args.dtype).stream(
            prompt_ids, params, args.max_tokens, stop_ids)
        return
    from pddjax.engines.paged_engine import EngineConfig, PagedEngine

    if args.page_size < 1:
        raise UserError(f"--page-size must be at least 1, got {args.page_size}")
    S = args.page_size
    pages = 2 + -(-(len(prompt_ids) + args.max_tokens) // S)
    try:
        eng = PagedEngine(model.config, model.weights, model.fingerprint,
                          EngineConfig(dtype=args.dtype, page_size=S, num_pages=pages,
                                       attention=args.attention or "auto", max_step_tokens=512, max_rows=1,
                                       prefix_cache=False, tensor_parallel=args.tensor_parallel))
    except ValueError as e:  # a degree the model does not admit, or too few devices
        raise UserError(str(e)) from None
    eng.add("cli", prompt_ids, params, args.max_tokens, stop_ids)
    while eng.has_work():
        for ev in eng.step():
            yield ev.token
