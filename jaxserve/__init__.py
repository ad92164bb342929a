"""jaxserve: JAX/XLA LLM serving with prefill/decode disaggregation.

`LLM`, `SamplingParams`, `Output` and `Guided` are imported on first use, so that `import jaxserve.<module>` does not
import JAX: a worker process must pin its CPUs before JAX loads (worker/setup.py).
"""

__all__ = ["LLM", "SamplingParams", "Output", "Guided"]


def __getattr__(name):
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name in ("SamplingParams", "Output"):
        from . import sampling
        return getattr(sampling, name)
    if name == "Guided":
        from .structured import Guided
        return Guided
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
