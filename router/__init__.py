"""The router: the engine client over a cluster's workers (cluster.py), worker registry, placement policies,
the launcher of worker processes, and `jaxserve serve` (serve.py, cli.py)."""
