import jax
import jax.numpy as jnp
import numpy as np
import pytest

# on a GPU the kernels are compiled (Pallas -> Triton); elsewhere their bodies are interpreted
INTERPRET = jax.default_backend() != "gpu"
MODE = "interpret" if INTERPRET else "pallas"
if not INTERPRET:  # float32 matmuls in full precision on both sides (GPUs default to TF32)
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a GPU, a case whose shapes the compiled kernels refuse (a ValueError saying "compiled for the GPU":
    dims that are not powers of two >= 16, layouts Triton cannot slice) is reported as skipped with that
    reason; the engine runs such kernels as their references (check.py)."""
    outcome = yield
    rep = outcome.get_result()
    exc = call.excinfo
    if not INTERPRET and exc is not None and exc.errisinstance(ValueError) and "compiled for the GPU" in str(exc.value):
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, str(exc.value).splitlines()[0])

# tolerance by dtype: kernels and references round the same products, bf16 differs in accumulation order
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def close(a, b, dtype):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=TOL[dtype], rtol=0)


def randn(r: np.random.RandomState, shape, dtype=jnp.float32):
    return jnp.asarray(r.randn(*shape), dtype)
