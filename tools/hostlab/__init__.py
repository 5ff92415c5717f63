"""The host lab: the simulator against `pddjax bench serve` on one development machine.

Calibration, step tables, step-log analysis, cross-core coupling and validation
(`python -m tools.hostlab.<module>`, README.md). It may import anything (jax, serving,
pddjax.sim); nothing in pddjax imports it.
"""
