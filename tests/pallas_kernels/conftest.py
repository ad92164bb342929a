import jax.numpy as jnp
import numpy as np

# tolerance by dtype: kernels and references round the same products, bf16 differs in accumulation order
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def close(a, b, dtype):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=TOL[dtype], rtol=0)


def randn(r: np.random.RandomState, shape, dtype=jnp.float32):
    return jnp.asarray(r.randn(*shape), dtype)
