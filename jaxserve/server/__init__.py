"""The OpenAI-compatible HTTP server."""
