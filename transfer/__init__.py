"""KV transfer: plans, frames, receive pools and links (TCP, shared memory, device pulls), link emulation, TLS,
and the segment allocator the KV pool shares. Imports nothing of the other packages."""
