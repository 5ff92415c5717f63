"""Constrained decoding on an engine service: the engine's grammar compiler, and each request's
grammar compiled before it reaches the engine thread.

`compiler_for(model)` builds the process's `GrammarCompiler` from the model's own tokenizer
(None for a model without one, such as `tiny`, and on a multi-host instance: a constrained
request is then refused). P, RLD
and MD each compile a request's grammar before its `add` (Prefill, Reserve): in a worker thread,
so a large schema never stalls the event loop, and once per process (the compiler's cache), so
the engine thread's `add` only copies the compiled matcher. What llguidance refuses, or a build
past its time bound, ends the call INVALID_ARGUMENT with llguidance's sentence.
"""

from __future__ import annotations

import asyncio

import grpc

from pddjax.model.sampling_params import SamplingParams


def compiler_for(model):
    """The grammar compiler of a loaded model (registry.LoadedModel), or None without a tokenizer."""
    if model.tokenizer is None:
        return None
    from pddjax.grammar.compiler import GrammarCompiler
    from pddjax.grammar.tokenizer import GrammarTokenizer

    cfg = model.config
    return GrammarCompiler(GrammarTokenizer.of(model.tokenizer, cfg.vocab_size, cfg.eos_token_ids))


async def compile_or_refuse(engine, params: SamplingParams, context) -> None:
    """Compile the request's grammar (if it has one) off the event loop; abort the call on refusal."""
    if params.grammar is None:
        return
    compiler = getattr(engine, "grammar", None)
    if compiler is None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "constrained decoding is not available here: it "
                                                              "needs the model's tokenizer and a single-host engine")
    try:
        await asyncio.to_thread(compiler.compile, params.grammar)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
