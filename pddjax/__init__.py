"""pddjax: cross-datacenter Prefill / RelayDecode / MainDecode LLM serving in JAX."""

__version__ = "0.1.0"
