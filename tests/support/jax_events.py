"""JAX's internal test events, counted: how a test sees traces, lowerings, compiles and
compiled calls that the executable counters cannot (a trace that hit a held executable)."""

from __future__ import annotations

import collections
import contextlib

import jax._src.util as jax_util


@contextlib.contextmanager
def jax_events():
    """{event: count} of JAX's internal test events while inside: 'trace_to_jaxpr' (a trace),
    'lower_jaxpr_to_module' (a lowering), 'pxla_cached_compilation' (an XLA compile or disk
    load), 'stages_compiled_call' (a compiled executable called through its Python path)."""
    counts: collections.Counter = collections.Counter()
    before = jax_util.test_event_listener

    def listen(name, *args):
        counts[name] += 1
        if before is not None:
            before(name, *args)

    jax_util.test_event_listener = listen
    try:
        yield counts
    finally:
        jax_util.test_event_listener = before
