"""Global scheduler and routing policies (arrives with the router issues)."""
