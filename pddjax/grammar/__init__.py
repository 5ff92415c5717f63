"""Constrained decoding on the host: which tokens a grammar allows next (llguidance).

`spec.GrammarSpec` is what a request asks for (no llguidance import: the router and
`SamplingParams` validate it); `tokenizer.GrammarTokenizer` is llguidance's view of a pddjax
tokenizer; `compiler.GrammarCompiler` compiles a spec once per tokenizer (a bounded LRU, a
bounded compile time); `matcher.Matcher` follows one sequence's tokens and fills its packed
allowed-token mask, which the jitted step applies (pddjax/model/token_mask.py). Plain Python
and numpy, no JAX.
"""
