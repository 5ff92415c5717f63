"""Benchmarks over real services (`pddjax bench serve`, `bench handoff`): outside the serving core."""
