"""Pallas kernels and their pure-jnp references (same signatures), selected in one place."""
