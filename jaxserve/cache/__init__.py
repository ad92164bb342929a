"""The KV cache: block manager with prefix caching and its events log (plain Python; the allocator is
transfer/segments.py), device pool layout (layout.py)."""
