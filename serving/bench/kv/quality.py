"""`pddjax bench kv-quality` (or `python -m serving.bench.kv.quality`): what a lossy KV wire
format costs on the real model, teacher-forced, next to the bytes it saves.

For each prompt (natural text from the repo's own docs, 200-1,000 tokens):
  1. the float32 path: prefill the prompt (dense cache), then decode `positions` tokens greedily:
     the reference continuation c_0 .. c_{N-1} (c_0 is P's first token, exact on every path);
  2. per format: the prompt's KV goes through the real wire path (kvwire.Chunker -> Assembler:
     encode, chunk, crc, decode into float32) and replaces the prompt's slots of the cache; one
     forward of c_0 .. c_{N-1} on top of it gives the next-token distributions at the N
     generated positions (teacher-forced: every format sees the same inputs);
  3. against the float32 path's distributions at the same positions: mean KL(p_f32 || p_fmt) in
     nats, top-1 agreement, and the greedy tokens that match before the first divergence (the
     first position whose argmax differs from c: up to there a free-running greedy decode with
     that KV would have produced exactly c).
`native` is in the table as the check that the path itself is exact (KL 0, agreement 1).
Bytes per prompt token are what the chunks carry (scales included), for every format with
zstd too (lossless: same quality as its base). Encode and decode times are the fastest of 3
pushes of the longest prompt, scaled to 1,000 tokens, against that push's time on a 20 Mb/s line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["README.md", "docs/sim.md", "docs/decisions.md", "docs/structure.md"]  # natural text shipped in the repo
LINE_MBPS = 20.0  # bench serve's emulated WAN


def register(bsub) -> None:
    p = bsub.add_parser("kv-quality", help="KL / top-1 / greedy agreement and bytes per token of each KV wire format")
    add_args(p)
    p.set_defaults(func=lambda a: run(a))


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4, help="prompts, lengths spread over [--min-len, --max-len]")
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=1000)
    p.add_argument("--positions", type=int, default=64, help="generated positions compared per prompt")
    p.add_argument("--formats", default="bf16,int8,fp8", help="lossy formats to measure (native is always in)")
    p.add_argument("--json", help="write the figures to this file")


def prompts_from_docs(tok, n: int, lo: int, hi: int) -> list[list[int]]:
    text = "\n\n".join(open(os.path.join(ROOT, f)).read() for f in TEXTS if os.path.exists(os.path.join(ROOT, f)))
    ids = tok.encode(text)
    lengths = np.linspace(lo, hi, n).round().astype(int) if n > 1 else np.array([hi])
    starts = np.linspace(0, max(0, len(ids) - hi - 1), n).round().astype(int)
    if len(ids) < hi:
        raise SystemExit(f"the repo's docs hold {len(ids)} tokens, fewer than --max-len {hi}")
    return [ids[s:s + m] for s, m in zip(starts, lengths)]


def _pad(n: int, step: int = 128) -> int:
    return -(-n // step) * step


def _push(fingerprint: str, k: np.ndarray, v: np.ndarray, fmt: str, first: int):
    """The prompt's KV [L, n, K, D] through the wire path in `fmt` -> (k, v float32, stats)."""
    from pddjax.kv.canonical import KVRun
    from serving import kvwire

    n = k.shape[1]
    t0 = time.perf_counter()
    ch = kvwire.Chunker("q", 0, n, 2 << 20, fmt, 16)
    msgs = ch.feed(KVRun(fingerprint, 0, k, v, "float32"), [first])
    t1 = time.perf_counter()
    asm = kvwire.Assembler(fingerprint, out_dtype="float32")
    parts = [asm.feed(m) for m in msgs]
    t2 = time.perf_counter()
    dk = np.concatenate([x.k for x in parts], axis=1)  # [L, n, K, D]
    dv = np.concatenate([x.v for x in parts], axis=1)
    return dk, dv, {"bytes": ch.bytes, "tokens": n, "encode_s": t1 - t0, "decode_s": t2 - t1}


class Forward:
    """The real model over a dense cache (jitted once per shape): prefill, greedy decode, and
    the teacher-forced chunk over a prompt KV put into the cache."""

    def __init__(self, model):
        import jax
        import jax.numpy as jnp

        from pddjax.model.dense import DenseKV, forward_dense

        self.jnp, self.DenseKV, self.cfg = jnp, DenseKV, model.config
        self.w = jax.tree.map(jnp.asarray, model.weights)
        self.fwd = jax.jit(forward_dense, static_argnums=(1,))

    def reference(self, prompt: list[int], N: int):
        """-> (cache after prefill, prompt KV (k, v) [L, n, K, D], float32 greedy continuation [N])."""
        jnp, n = self.jnp, len(prompt)
        toks = jnp.asarray(np.pad(prompt, (0, _pad(n) - n)), jnp.int32)[None]  # [1, Tp]
        cache = self.DenseKV.zeros(self.cfg, 1, _pad(n) + N, jnp.float32)  # [L, 1, C, K, D]
        logits, cache = self.fwd(self.w, self.cfg, toks, jnp.arange(_pad(n), dtype=jnp.int32)[None], cache,
                                 jnp.asarray([n - 1], jnp.int32))
        kv = (np.asarray(cache.k[:, 0, :n]), np.asarray(cache.v[:, 0, :n]))
        cont, c = [int(jnp.argmax(logits[0, 0]))], cache  # c_0: P's first token
        for i in range(N - 1):
            tok, at = jnp.asarray([[cont[-1]]], jnp.int32), jnp.asarray([[n + i]], jnp.int32)  # [1, 1]
            lg, c = self.fwd(self.w, self.cfg, tok, at, c)
            cont.append(int(jnp.argmax(lg[0, 0])))
        return cache, kv, cont

    def forced(self, cache, k: np.ndarray, v: np.ndarray, cont: list[int]) -> np.ndarray:
        """Logits [N, V] (float64) of the chunk c_0 .. c_{N-1} over prompt KV k, v [L, n, K, D]."""
        jnp, n, N = self.jnp, k.shape[1], len(cont)
        ck = cache.k.at[:, 0, :n].set(jnp.asarray(k))  # [L, 1, C, K, D]
        cv = cache.v.at[:, 0, :n].set(jnp.asarray(v))
        pos = (n + jnp.arange(N, dtype=jnp.int32))[None]  # [1, N]
        out = self.fwd(self.w, self.cfg, jnp.asarray(cont, jnp.int32)[None], pos, self.DenseKV(ck, cv))[0]
        return np.asarray(out[0], np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def run(args) -> int:
    from pddjax.model.jax_setup import configure

    configure()  # the persistent compilation cache; the platform (cpu unless JAX_PLATFORMS says otherwise)
    from pddjax.kv import codec
    from pddjax.model.registry import load_model

    model = load_model(args.model)
    m, N = Forward(model), args.positions
    formats = ["native", *[f for f in args.formats.split(",") if f and f != "native"]]
    for f in formats:
        codec.parse(f)
    prompts = prompts_from_docs(model.tokenizer, args.prompts, args.min_len, args.max_len)
    per: dict[str, dict[str, list]] = {f: {"kl": [], "top1": [], "match": []} for f in formats}
    t_start = time.perf_counter()
    for pi, p in enumerate(prompts):
        cache, kv, cont = m.reference(p, N)
        ref = m.forced(cache, *kv, cont)  # [N, V]
        ref_lp = _log_softmax(ref)
        self_check = int((ref[:-1].argmax(-1) == np.asarray(cont[1:])).sum())
        for f in formats:
            k, v, _ = _push(model.fingerprint, *kv, f, cont[0])
            lg = m.forced(cache, k, v, cont)
            kl = (np.exp(ref_lp) * (ref_lp - _log_softmax(lg))).sum(-1)  # [N] nats
            differs = np.flatnonzero(lg[:-1].argmax(-1) != np.asarray(cont[1:]))
            per[f]["kl"] += kl.tolist()
            per[f]["top1"] += (lg.argmax(-1) == ref.argmax(-1)).tolist()
            per[f]["match"].append(int(differs[0]) + 1 if len(differs) else N)  # c_0 always matches
        print(f"prompt {pi + 1}/{len(prompts)}: {len(p)} tokens, float32 self-check {self_check}/{N - 1}, "
              + ", ".join(f"{f} KL {np.mean(per[f]['kl'][-N:]):.2e} match {per[f]['match'][-1]}" for f in formats)
              + f" ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    wire = {}  # the longest prompt's push per format: its bytes, and the fastest of 3 encodes and decodes
    for f in codec.FORMATS:
        tries = [_push(model.fingerprint, *kv, f, cont[0])[2] for _ in range(3)]
        wire[f] = {**tries[0], "encode_s": min(t["encode_s"] for t in tries),
                   "decode_s": min(t["decode_s"] for t in tries)}
    native_bpt = wire["native"]["bytes"] / wire["native"]["tokens"]
    out = {"model": model.config.name, "prompt_tokens": [len(p) for p in prompts], "positions": N,
           "line_mbps": LINE_MBPS, "formats": {}}
    print(f"\n{'format':12s} {'mean KL':>9s} {'top-1':>7s} {'greedy match':>22s} {'B/token':>9s} {'ratio':>6s} "
          f"{'enc+dec ms/1k':>13s} {'of push':>8s}")
    for f in codec.FORMATS:
        wf = wire[f]
        bpt, per_1k = wf["bytes"] / wf["tokens"], 1e3 * 1000 / wf["tokens"]
        codec_ms = (wf["encode_s"] + wf["decode_s"]) * per_1k
        push_ms = 1e3 * 8 * bpt * 1000 / (LINE_MBPS * 1e6)
        row = {"bytes_per_token": bpt, "ratio": bpt / native_bpt, "encode_ms_per_1k": wf["encode_s"] * per_1k,
               "decode_ms_per_1k": wf["decode_s"] * per_1k, "codec_share_of_push": codec_ms / push_ms}
        q = per.get(codec.parse(f).base) if f.endswith("+zstd") else per.get(f)  # zstd is lossless
        if q:
            row |= {"mean_kl": float(np.mean(q["kl"])), "max_kl": float(np.max(q["kl"])),
                    "top1": float(np.mean(q["top1"])), "greedy_match": q["match"],
                    "greedy_match_mean": float(np.mean(q["match"]))}
        out["formats"][f] = row
        qs = (f"{row['mean_kl']:9.2e} {row['top1']:7.2%} {str(row['greedy_match']):>22s}" if q
              else f"{'-':>9s} {'-':>7s} {'-':>22s}")
        print(f"{f:12s} {qs} {bpt:9.0f} {row['ratio']:6.3f} {codec_ms:13.1f} {row['codec_share_of_push']:8.1%}")
    print(f"({len(prompts)} prompts of {out['prompt_tokens']} tokens, {N} positions each; greedy match = tokens equal "
          f"to float32's before the first divergence, of {N}; enc+dec on the {kv[0].shape[1]}-token push, per 1,000 "
          f"tokens, and its share of that push's time at {LINE_MBPS:g} Mb/s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
