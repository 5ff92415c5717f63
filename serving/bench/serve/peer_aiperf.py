"""AIPerf (NVIDIA's OpenAI benchmark client) as `bench serve --peer aiperf` runs it: its own venv,
an offline tokenizer, its command line, and its output read back.

- Venv: AIPerf pins versions this project's venv holds newer (huggingface-hub < 2, rich ~= 14.1,
  prometheus-client ~= 0.23.1, psutil ~= 7.0.0, orjson ~= 3.11.7) and brings ~1.2 GB (transformers,
  pandas, pyarrow, dash, ...), so it runs from a venv of its own: `ensure` creates one with
  `REQUIREMENT` (the `peer` extra in pyproject.toml says the same) where none is, by default under
  the pddjax cache (`default_venv`).
- Tokenizer: AIPerf counts prompt tokens with a Hugging Face tokenizer. In offline mode
  (HF_HUB_OFFLINE=1) it resolves a tokenizer name through the hub cache only (a directory path
  fails there), so `write_tokenizer` lays the served model's tokenizer (tokenizer.json,
  tokenizer_config.json) out as a hub-cache snapshot of the repo id `pddjax/<model>` under a folder
  that `environment` names as HF_HUB_CACHE; nothing is fetched.
- Command (`command`): the `single_turn` JSONL of `peer_load.write_aiperf` on `--fixed-schedule`
  (each request at its timestamp), streamed completions, `ignore_eos` and temperature 0 as extra
  inputs, the server's token counts (`--use-server-token-count`: usage in the stream), no UI, GPU
  telemetry or server metrics.
- Output (`read`): `profile_export.jsonl` (one record per request: TTFT, inter-chunk latencies,
  inter-token latency, in ms) and `profile_export_aiperf.json` (AIPerf's own percentiles). AIPerf's
  names differ from vLLM's: its "inter token latency" = (request latency - TTFT) / (tokens - 1) is
  vLLM's TPOT, its "inter chunk latency" (one gap per streamed message) is vLLM's ITL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import urllib.parse

REQUIREMENT = "aiperf==0.13.0"  # as the `peer` extra in pyproject.toml
RECORDS, SUMMARY = "profile_export.jsonl", "profile_export_aiperf.json"
# AIPerf's summary metric -> the vLLM-named figure it is
SUMMARY_KEYS = {"ttft_ms": "time_to_first_token", "itl_ms": "inter_chunk_latency", "tpot_ms": "inter_token_latency"}


@dataclasses.dataclass
class PeerRecord:
    """One request as AIPerf measured it (ms)."""

    ttft_ms: float | None
    itl_message_ms: list  # AIPerf's inter_chunk_latency: one gap per streamed message
    tpot_ms: float | None  # AIPerf's inter_token_latency
    e2e_ms: float | None  # AIPerf's request_latency
    output_tokens: int | None
    error: str | None = None


def default_venv() -> str:
    from pddjax.model.fingerprint import cache_root

    return os.path.join(cache_root(), "peer", REQUIREMENT.replace("==", "-"))


def executable(venv: str) -> str:
    return os.path.join(venv, "bin", "aiperf")


def ensure(venv: str, install: bool = True) -> str:
    """The `aiperf` executable of `venv`, creating the venv with `REQUIREMENT` first where it has none."""
    exe = executable(venv)
    if os.path.exists(exe):
        return exe
    if not install:
        from pddjax.errors import UserError

        raise UserError(f"no AIPerf at {exe}: run without --peer-no-install, or "
                        f"`python -m venv {venv} && {venv}/bin/pip install {REQUIREMENT}`")
    print(f"peer: installing {REQUIREMENT} into its own venv {venv} (~1.2 GB, once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", REQUIREMENT], check=True)
    return exe


def write_tokenizer(tokenizer, model: str, max_context: int, hub_cache: str) -> str:
    """The served tokenizer as a hub-cache snapshot under `hub_cache`; -> its repo id."""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in os.path.basename(model.rstrip("/")))
    repo = f"pddjax/{name.removesuffix('.gguf') or 'model'}"
    spec = tokenizer.tok.to_str()

    def text(i):
        return None if i is None else tokenizer.token_text(i)

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(tokenizer.bos_id),
              "eos_token": text(tokenizer.eos_id), "add_bos_token": bool(tokenizer.add_bos),
              "model_max_length": max_context, "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    commit = hashlib.sha1(spec.encode() + json.dumps(config, sort_keys=True).encode()).hexdigest()
    root = os.path.join(hub_cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(snapshot, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(spec)
    with open(os.path.join(snapshot, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(commit)
    return repo


def environment(hub_cache: str, home: str) -> dict:
    """AIPerf's environment: offline, the tokenizer's hub cache, Hugging Face's home under `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": hub_cache,
            "HF_HOME": os.path.join(home, "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def command(exe: str, url: str, model: str, tokenizer_repo: str, input_file: str, out_dir: str,
            api_key: str | None = None) -> list[str]:
    """AIPerf's command line for the fixed-schedule load in `input_file` against OpenAI base URL `url`."""
    u = urllib.parse.urlsplit(url)
    endpoint = (u.path.rstrip("/") or "/v1") + "/completions"
    cmd = [exe, "profile", "--model", model, "--url", f"{u.scheme}://{u.netloc}", "--endpoint", endpoint,
           "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer_repo,
           "--input-file", input_file, "--custom-dataset-type", "single_turn", "--fixed-schedule",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0", "--use-server-token-count",
           "--random-seed", "0", "--ui", "none", "--no-gpu-telemetry", "--no-server-metrics",
           "--output-artifact-dir", out_dir]
    return cmd + (["--api-key", api_key] if api_key else [])


def _ms(metrics: dict, key: str):
    v = (metrics.get(key) or {}).get("value")
    return v if isinstance(v, (int, float, list)) else None


def read_records(out_dir: str) -> list[PeerRecord]:
    """The profiling phase's records of AIPerf's `profile_export.jsonl` in `out_dir`."""
    out = []
    with open(os.path.join(out_dir, RECORDS), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            meta, m = row.get("metadata") or {}, row.get("metrics") or {}
            if meta.get("benchmark_phase", "profiling") != "profiling":
                continue
            err = row.get("error")
            osl = _ms(m, "usage_completion_tokens") or _ms(m, "output_sequence_length")
            out.append(PeerRecord(ttft_ms=_ms(m, "time_to_first_token"), itl_message_ms=_ms(m, "inter_chunk_latency")
                                  or [], tpot_ms=_ms(m, "inter_token_latency"), e2e_ms=_ms(m, "request_latency"),
                                  output_tokens=None if osl is None else int(osl),
                                  error=None if not err and not meta.get("was_cancelled") else str(err or "cancelled")))
    return out


def read_summary(out_dir: str) -> dict:
    """AIPerf's own p50 / p99 of TTFT, ITL (its inter chunk latency) and TPOT (its inter token latency),
    its request count and its version, from `profile_export_aiperf.json`."""
    with open(os.path.join(out_dir, SUMMARY), encoding="utf-8") as f:
        d = json.load(f)
    out: dict = {k: {s: (d.get(src) or {}).get(s) for s in ("p50", "p99")} for k, src in SUMMARY_KEYS.items()}
    out["requests"] = (d.get("request_count") or {}).get("avg")
    out["errors"] = len(d.get("error_summary") or [])
    out["version"] = d.get("aiperf_version")
    out["schedule_lag_p50_ms"] = (d.get("replay_sched_lag_p50") or {}).get("avg")
    return out
