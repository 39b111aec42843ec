"""shardplug.attention: XLA's attention off a GPU (the same numbers as jax.nn's), cuDNN's
fused kernel chosen on a GPU where the inputs qualify, the reason said where they do not,
its FLOPs counted, and a parallelism's implementation in its place when one is installed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardplug
import shardplug.errors
from shardplug.core.flops import step_flops
from shardplug.core.operations import attention as attention_module
from shardplug.core.operations.attention import choose
from shardplug.core.ops import Operations, supplying

B, T, N, H = 2, 32, 4, 16


def qkv(dtype=jnp.float32, heads=N, head=H):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (B, T, heads, head), dtype) for k in keys]


def test_off_a_gpu_it_is_jax_s_attention():
    q, k, v = qkv()
    for causal in (False, True):
        np.testing.assert_array_equal(
            shardplug.attention(q, k, v, causal=causal),
            jax.nn.dot_product_attention(q, k, v, is_causal=causal),
        )
    grouped = shardplug.attention(q, k[:, :, :2], v[:, :, :2], causal=True)  # 2 kv heads
    assert grouped.shape == q.shape


@pytest.mark.parametrize(
    ("platform", "dtype", "head", "chosen", "why"),
    [
        ("cpu", jnp.bfloat16, 64, "xla", None),
        ("gpu", jnp.bfloat16, 64, "cudnn", None),
        ("gpu", jnp.float16, 128, "cudnn", None),
        ("gpu", jnp.float32, 64, "xla", "take XLA's attention: cuDNN's fused attention takes "
                                         "bfloat16 or float16 (train with --precision bf16, or "
                                         "precision='bf16' in Python)"),
        ("gpu", jnp.bfloat16, 12, "xla", "head dimension 12"),
    ],
)
def test_cudnn_where_the_inputs_qualify(platform, dtype, head, chosen, why):
    q = jax.ShapeDtypeStruct((B, T, N, head), dtype)
    implementation, reason = choose(q, q, q, platform=platform)
    assert implementation == chosen
    assert (reason is None) if why is None else why in reason


def test_a_parallelism_replaces_its_inside():
    seen = []

    def ring(query, key, value, *, causal, bias, mask, scale):
        seen.append((query.shape, causal))
        return jnp.zeros_like(query)

    q, k, v = qkv()
    with supplying([("ring", Operations(attention=ring))]):
        out = jax.jit(lambda q, k, v: shardplug.attention(q, k, v, causal=True))(q, k, v)
    assert seen == [((B, T, N, H), True)] and not out.any()
    assert shardplug.attention(q, k, v).any()  # outside, its own again


def test_fused_attention_flops_are_counted(monkeypatch):
    """cuDNN's kernel is a custom call, no dot_general: step_flops counts it by its shapes,
    2 products forward and 5 backward (flash attention recomputes the scores), halved when
    causal. Traced here by telling JAX's cuDNN wrapper a cuDNN exists (nothing runs)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)
    q = jax.ShapeDtypeStruct((B, T, N, 64), jnp.bfloat16)
    per_product = 2.0 * B * N * T * T * 64
    for causal in (False, True):

        def loss(q, k, v, causal=causal):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
            return out.astype(jnp.float32).sum()

        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q)
        assert step_flops(jaxpr) == (2 + 5) * per_product / (2 if causal else 1)


def test_a_fallback_is_said_once(monkeypatch):
    monkeypatch.setattr(attention_module, "_platform", lambda: "gpu")
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    q, k, v = qkv(jnp.float32)
    with pytest.warns(shardplug.ShardplugWarning, match="float32 inputs take XLA's attention"):
        shardplug.attention(q, k, v, causal=True)
    shardplug.attention(q, k, v, causal=True)  # a second warning would fail the suite


def test_explicitly_sharded_inputs_cudnn_refuses_fall_back_with_a_line(monkeypatch):
    """Where cuDNN's wrapper refuses inputs (here: no cuDNN on this machine; on a GPU, an
    explicit sharding it has no rule for), XLA's attention runs, said once."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(attention_module, "_platform", lambda: "gpu")
    monkeypatch.setattr(shardplug.errors, "_SAID", set())  # said afresh
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q = jax.random.normal(jax.random.key(0), (4, 8, 4, 16), jnp.bfloat16)
    with jax.set_mesh(mesh):
        qs = jax.device_put(q, P("data", None, "model", None))
        with pytest.warns(shardplug.ShardplugWarning, match="cuDNN's fused attention refused"):
            out = jax.jit(lambda x: shardplug.attention(x, x, x, causal=True))(qs)
    want = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_allclose(np.float32(out), np.float32(want), rtol=2e-2, atol=2e-2)
