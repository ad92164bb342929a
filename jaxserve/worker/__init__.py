"""Worker processes: one instance (prefill, decode or both) per process, controlled over gRPC."""
