"""The workloads of `pddjax bench speculative`: prompts as token ids, with their sampling.

- `copy`: turns that edit or quote their context (a JSON rewrite, a code edit, a tool output
  quoted, a config changed): most of the answer is in the prompt, prompt lookup's best case.
- `agentic`: the first requests of `bench serve --quick`'s generated trace (seed 0): token-id
  prompts over the shared documents, each with the trace's own output length.
- `nomatch`: open-ended answers sampled at temperature 1.0 (seeded): little to copy from the
  prompt or from the output itself, so drafts are mostly rejected and speculation should turn
  itself off.
Each workload has 4 requests; the 1-stream column runs them one after another, the 4-stream
column all at once.
"""

from __future__ import annotations

import dataclasses
import json

from pddjax.model.sampling_params import SamplingParams

STREAMS = 4  # requests per workload

_CONFIG = {"service": "checkout", "replicas": 3, "region": "eu-west-1", "timeout_ms": 2500,
           "retries": {"max": 4, "backoff_ms": 200}, "features": ["cache", "audit", "metrics"]}

_CODE = '''def compute_total(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def format_receipt(items, tax_rate):
    lines = []
    for item in items:
        lines.append(f"{item['name']}: {item['price'] * item['quantity']:.2f}")
    lines.append(f"total: {compute_total(items, tax_rate):.2f}")
    return "\\n".join(lines)
'''

_TOOL = """$ pytest tests/test_orders.py
tests/test_orders.py::test_create_order PASSED
tests/test_orders.py::test_cancel_order FAILED
tests/test_orders.py::test_refund_order PASSED
FAILED tests/test_orders.py::test_cancel_order - AssertionError: expected status 'cancelled', got 'pending'
1 failed, 2 passed in 0.42s"""

_YAML = """server:
  host: 0.0.0.0
  port: 8080
  workers: 4
database:
  url: postgres://db.internal:5432/orders
  pool_size: 10
logging:
  level: info
  format: json"""

COPY = (
    f"Here is a JSON object:\n{json.dumps(_CONFIG, indent=2)}\n"
    "Rewrite it with \"replicas\" set to 5. Output only the full JSON object.",
    f"Here is some Python code:\n{_CODE}\nRename the function compute_total to sum_order everywhere. "
    "Output the whole updated code.",
    f"A tool returned this output:\n{_TOOL}\nQuote the line that reports the failure exactly, then repeat "
    "the test names that passed.",
    f"Here is a YAML config:\n{_YAML}\nChange the port to 9090 and the log level to debug. Output the "
    "whole updated YAML.",
)

NOMATCH = (
    "Write a short poem about a lighthouse keeper who befriends a storm.",
    "Invent a new board game and describe its rules in a few sentences.",
    "Describe the taste of a fruit that does not exist.",
    "Tell a very short story about a robot learning to paint.",
)


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]  # [prompt tokens]
    max_tokens: int
    params: SamplingParams
    stop_ids: tuple[int, ...] | None  # None: the model's EOS ids


def build(name: str, model, max_tokens: int) -> list[Request]:
    """The workload `name`'s requests for `model` (a registry LoadedModel with a tokenizer)."""
    tok = model.tokenizer
    if name == "copy":
        return [Request(tok.encode_chat([{"role": "user", "content": c}]), max_tokens, SamplingParams(), None)
                for c in COPY]
    if name == "nomatch":
        return [Request(tok.encode_chat([{"role": "user", "content": c}]), max_tokens,
                        SamplingParams(temperature=1.0, seed=100 + i), None) for i, c in enumerate(NOMATCH)]
    if name == "agentic":
        return _agentic(model, max_tokens)
    raise ValueError(f"unknown workload {name!r}; expected copy, agentic or nomatch")


def _agentic(model, max_tokens: int) -> list[Request]:
    """The first turn-0 requests of `bench serve --quick`'s trace: prompts of token ids over the
    shared documents (as that bench builds them), ignoring EOS up to the trace's output length."""
    from pddjax.workload import TokenBuilder, generate
    from serving.bench.serve.command import bench_workload

    cfg = bench_workload(True, 0, None, model.config)
    builder = TokenBuilder(cfg.seed, model.config.vocab_size)
    firsts = [r for r in generate(cfg) if r.turn == 0][:STREAMS]
    return [Request(builder.prompt_ids(r), min(max_tokens, max(8, r.output_tokens)), SamplingParams(), ())
            for r in firsts]
