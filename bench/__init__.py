"""Benchmarks: each writes one JSON object."""
