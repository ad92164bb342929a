"""Prefill/decode disaggregation: each side's glue between its LLMEngine and the transfer layer."""
