"""KV transfer layer (arrives with the disaggregation issue)."""
