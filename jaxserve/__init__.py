"""jaxserve: JAX/XLA LLM serving with prefill/decode disaggregation."""

from .llm import LLM
from .sampling import Output, SamplingParams

__all__ = ["LLM", "SamplingParams", "Output"]
