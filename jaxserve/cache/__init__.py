"""The KV cache: segment allocator and block manager (plain Python), device pool layout (layout.py)."""
