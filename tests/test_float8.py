"""float8 matrix products (``shardplug.finetuning.float8``): e4m3 forward, e5m2 gradients, scaled
per
tensor or per row, against float32 within float8's error; zeros, outliers and NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardplug.errors import ConfigError
from shardplug.finetuning.float8 import float8_dot_general, relative_error

KEYS = jax.random.split(jax.random.key(0), 3)
MATMUL = (((1,), (0,)), ((), ()))
BATCHED_TRANSPOSED = (((2,), (2,)), ((0,), (0,)))  # (b, t, in) by (b, out, in)


def _errors(x, w, numbers, scaling, cotangent):
    def float8(x, w):
        return float8_dot_general(x, w, numbers, scaling=scaling)

    def exact(x, w):
        return jax.lax.dot_general(x, w, numbers, precision=jax.lax.Precision.HIGHEST)

    out, pull = jax.vjp(float8, x, w)
    want, pull_exact = jax.vjp(exact, x, w)
    grads = zip(pull(cotangent), pull_exact(cotangent), strict=True)
    return relative_error(out, want), [relative_error(a, b) for a, b in grads]


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize(("shapes", "numbers"), [
    (((64, 256), (256, 128), (64, 128)), MATMUL),
    (((4, 32, 64), (4, 48, 64), (4, 32, 48)), BATCHED_TRANSPOSED),
])  # fmt: skip
def test_a_float8_product_and_its_gradients_are_float32_s_within_float8_s_error(
    scaling, shapes, numbers
):
    x, w, ct = (jax.random.normal(k, s) for k, s in zip(KEYS, shapes, strict=True))
    forward, (d_x, d_w) = _errors(x, w * 0.05, numbers, scaling, ct)
    # e4m3 rounds each operand by at most 1/16, e5m2 the gradient by 1/8; the terms'
    # errors partly cancel: about 3.7% forward, 5.5% for the gradients
    assert 0.01 < forward < 0.05
    assert 0.02 < d_x < 0.08 and 0.02 < d_w < 0.08  # not exact: float8 is what ran


def test_an_outlier_costs_its_row_alone_under_row_scaling():
    x = jax.random.normal(KEYS[0], (64, 256)).at[0, 0].set(1e6)
    w = jax.random.normal(KEYS[1], (256, 128))
    want = x @ w
    rest = {s: relative_error(float8_dot_general(x, w, MATMUL, scaling=s)[1:], want[1:])
            for s in ("tensor", "row")}  # fmt: skip
    assert rest["row"] < 0.05  # each other token's own scale
    assert rest["tensor"] > 0.2  # one scale: the others fall below float8's normal range


def test_zeros_multiply_to_zeros_and_a_nan_makes_the_product_nan():
    zero = float8_dot_general(jnp.zeros((4, 8)), jnp.zeros((8, 3)), MATMUL)
    np.testing.assert_array_equal(zero, np.zeros((4, 3)))
    for scaling in ("tensor", "row"):
        bad = float8_dot_general(jnp.ones((4, 8)).at[0, 0].set(jnp.nan), jnp.ones((8, 3)),
                                 MATMUL, scaling=scaling)  # fmt: skip
        assert np.isnan(np.asarray(bad[0])).all()  # the step's loss says it: --on-nonfinite
        inf = float8_dot_general(jnp.ones((4, 8)).at[1, 2].set(jnp.inf), jnp.ones((8, 3)),
                                 MATMUL, scaling=scaling)  # fmt: skip
        assert np.isnan(np.asarray(inf[1])).all()


def test_an_unknown_scaling_is_one_line():
    with pytest.raises(ConfigError, match=r"float8: scaling must be one of tensor, row, got "
                                          r"'block'"):  # fmt: skip
        float8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), MATMUL, scaling="block")
