"""Agentic multi-turn workload: seeded generator, JSONL trace format, token ids for replay."""

from pddjax.workload.config import DEFAULT_HIT_MIX, PRESETS, WorkloadConfig, fixed_hit_mix, mix_mean
from pddjax.workload.generator import config_dict, generate
from pddjax.workload.tokens import TokenBuilder
from pddjax.workload.trace import TraceRequest, read_trace, summarize, write_trace

__all__ = [
    "DEFAULT_HIT_MIX", "PRESETS", "WorkloadConfig", "fixed_hit_mix", "mix_mean", "config_dict",
    "generate", "TokenBuilder", "TraceRequest", "read_trace", "summarize", "write_trace",
]
