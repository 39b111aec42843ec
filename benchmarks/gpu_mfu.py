"""A GPT on one GPU: shardplug through the user's path against a hand-written ``jax.jit`` loop.

``python benchmarks/gpu_mfu.py --size 125m`` (or ``350m``, ``1b``, ...) trains the same
decoder-only transformer two ways in one process, in interleaved rounds:

- **shardplug, as a user would**: the model written with Flax NNX's stock layers and no dtype
  (``nnx.Embed``, ``nnx.Linear``, ``nnx.LayerNorm``, :func:`shardplug.attention`), a
  ``shardplug.Trainer`` with ``precision="bf16"``, ``dp`` on every device (one GPU). It is
  also a task file: ``shardplug train --task benchmarks/gpu_mfu.py:gpt_125m --precision
  bf16`` runs the same thing from the command line;
- **by hand**: the same model built with bfloat16 modules (``dtype=bfloat16``, float32
  parameters) and cuDNN's fused attention named outright, updated by AdamW in a ``jax.jit``
  step that donates its state, as Flax's documentation writes it.

It prints one JSON object: per-step time of each and their ratio, tokens/s, model TFLOP/s
(MaxText's count, :mod:`shardplug.core.flops`) and MFU over the chip's dense bfloat16 peak
(989.4 TFLOP/s for H100 SXM and H200; ``--peak-tflops`` for others), hardware TFLOP/s (the
traced step's own count, :func:`shardplug.core.flops.step_flops`, recomputation and the fused
attention kernel included), the share of matrix-product FLOPs in bfloat16, and the peak
memory that ``explain`` predicts (the compiled step's memory analysis) next to the one the
GPU measured (``peak_bytes_in_use``, read before the hand-written loop allocates).

``--plan`` trains nothing: it plans every size at the given batch without allocating (as
``shardplug explain`` does) and reports the largest that fits the device's memory (the
limit JAX gives this process, 75% of a GPU's unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says
otherwise, or ``--device-memory``). ``--size smoke`` runs a tiny model on any backend, so
the script is tested on CPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from typing import Any

PEAKS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
REMAT = ("none", "dots", "full", "offload")


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    sequence: int = 1024
    batch: int = 16
    vocab: int = 50304


SIZES = {  # GPT-3's table (Brown et al., 2020), and a 1B of 16 wide layers
    "125m": Size(12, 768, 12, batch=32),
    "350m": Size(24, 1024, 16),
    "760m": Size(24, 1536, 16),
    "1b": Size(16, 2048, 16),
    "1.3b": Size(24, 2048, 16),
    "2.7b": Size(32, 2560, 32, batch=8),
    "6.7b": Size(32, 4096, 32, batch=8),
    "smoke": Size(2, 64, 4, sequence=64, batch=8, vocab=512),
}


def gpt(size: Size, *, dtype: Any = None, attend: Any = None, remat: str = "none") -> Any:
    """``rngs -> GPT``: a pre-norm GPT with learned positions, written with NNX's stock layers.

    ``dtype`` is the layers' compute dtype (None: as their inputs and parameters, which is
    how a user writes it); ``attend(q, k, v)`` the causal attention (default
    :func:`shardplug.attention`).
    """
    import jax.numpy as jnp
    from flax import nnx

    import shardplug

    attend = attend or (lambda q, k, v: shardplug.attention(q, k, v, causal=True))
    init = nnx.initializers.normal(0.02)
    width, heads = size.width, size.heads

    def linear(n_in, n_out, rngs):
        return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
            self.qkv = linear(width, 3 * width, rngs)
            self.out = linear(width, width, rngs)
            self.norm2 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
            self.up = linear(width, 4 * width, rngs)
            self.down = linear(4 * width, width, rngs)

        def __call__(self, x):
            b, s, _ = x.shape
            q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
            q, k, v = (t.reshape(b, s, heads, width // heads) for t in (q, k, v))
            x = x + self.out(attend(q, k, v).reshape(b, s, width))
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(size.vocab, width, embedding_init=init, dtype=dtype, rngs=rngs)
            self.position = nnx.Embed(size.sequence, width, embedding_init=init, dtype=dtype,
                                      rngs=rngs)  # fmt: skip
            self.blocks = nnx.List([Block(rngs) for _ in range(size.layers)])
            self.norm = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
            self.unembed = linear(width, size.vocab, rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))[None]
            for block in self.blocks:
                x = _remat(block, remat)(x)
            return self.unembed(self.norm(x))

    return GPT


def _remat(block: Any, policy: str) -> Any:
    """The block, its activations kept (``none``), all recomputed in the backward pass
    (``full``), all but the matrix products' outputs recomputed (``dots``), or all
    recomputed from its input kept in host memory (``offload``: shardplug's policy, as
    ``--remat offload`` runs it)."""
    import jax
    from flax import nnx

    from shardplug.core.operations.remat import named_input, saveable

    if policy == "none":
        return block
    if policy == "offload":
        run = nnx.remat(named_input(lambda b, x: b(x), "offload"), policy=saveable("offload"))
        return lambda x: run(block, x)
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    run = nnx.remat(lambda b, x: b(x), policy=dots if policy == "dots" else None)
    return lambda x: run(block, x)


def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
    """Next-token cross-entropy, the logits in float32."""
    import jax.numpy as jnp
    import optax

    logits = model(batch["tokens"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def optimizer() -> Any:
    import optax

    return optax.adamw(3e-4, weight_decay=0.1)


def batches(size: Size, batch: int, count: int = 4) -> list[dict[str, Any]]:
    """``count`` batches of random tokens (the benchmark is about speed, not learning)."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, size.vocab, (batch, size.sequence + 1), dtype=np.int32)
        out.append({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def task(name: str = "125m", batch: int | None = None, remat: str = "none") -> Any:
    """The GPT of ``SIZES[name]`` as a shardplug task, written as a user writes it."""
    import itertools

    import shardplug
    from shardplug.core.flops import TransformerShape

    size = SIZES[name]
    batch = batch or size.batch
    shape = TransformerShape(size.layers, size.width, size.sequence, size.vocab)
    data = batches(size, batch)
    return shardplug.Task(
        adapter=shardplug.from_nnx(gpt(size, remat=remat)),
        loss_fn=loss_fn,
        optimizer=optimizer(),
        data=lambda: itertools.cycle(data),
        name=f"gpt-{name}",
        flops_per_sample=shape.flops_per_token()["total"] * size.sequence,
    )


def gpt_125m() -> Any:
    return task("125m")


def gpt_350m() -> Any:
    return task("350m")


def gpt_1b() -> Any:
    return task("1b")


def hand_written(size: Size, batch: int, remat: str, seed: int = 0,
                 device: Any = None) -> tuple[Any, Any, Any]:  # fmt: skip
    """The same model with bfloat16 modules and cuDNN attention (XLA's off a GPU), and a
    ``jax.jit`` step over its state; ``(step, state, trace)``. With a compile-only
    ``device`` (``target_devices``) the state is abstract, placed on it, and cuDNN's
    attention is lowered for its GPU: ``trace.lower().compile()`` is that GPU's program."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    gpu = device is not None or jax.default_backend() == "gpu"
    kind = "cudnn" if gpu else "xla"

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kind)

    build = gpt(size, dtype=jnp.bfloat16, attend=attend, remat=remat)
    abstract = device is not None
    model = nnx.eval_shape(lambda: build(nnx.Rngs(seed))) if abstract else build(nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optimizer()
    state = (params, tx.init(params) if device is None else jax.eval_shape(tx.init, params))

    def step(state, batch):
        params, opt_state = state

        def loss(p):
            return loss_fn(nnx.merge(graphdef, p), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    step = jax.jit(step, donate_argnums=0)
    example = batches(size, batch, 1)[0]
    if device is None:
        return step, state, step.trace(state, example)
    placed = jax.sharding.SingleDeviceSharding(device)

    def on(x: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed)

    state, example = jax.tree.map(on, (state, example))
    from shardplug.core.compiled.targets import as_present

    with as_present(device):
        return step, state, step.trace(state, example)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    """The largest size whose planned peak fits the device, planned without allocating."""
    import jax

    import shardplug
    from shardplug.planning.explain import backend_memory, explain, memory_limit_note

    devices = 1
    if args.target:  # compiled on this CPU machine for a GPU not here
        from shardplug.core.compiled.targets import memory_of, target_devices

        devices = target_devices(args.target, 1)
    device = jax.devices()[0] if devices == 1 else devices[0]
    memory = args.device_memory or (memory_of(device) if args.target else None)
    memory = memory or backend_memory(device)
    rows = []
    for name in args.sizes.split(","):
        t = task(name, args.batch or 8, args.remat)
        trainer = shardplug.Trainer(
            t.adapter, loss_fn=t.loss_fn, optimizer=t.optimizer, strategy=_strategy(args),
            devices=devices, precision=args.precision, allocate=False,
        )  # fmt: skip
        report = explain(trainer, next(iter(t.batches())), device_memory=memory)
        peak = report.per_device["peak_bytes"]
        params = sum(math.prod(p.shape) for p in report.params)
        timing = report.timing or {}  # a GPU's program: its step predicted
        rows.append({"size": name, "params": params, "peak_bytes": peak,
                     "fits": memory is not None and peak <= memory,
                     "predicted_step_seconds": timing.get("seconds"),
                     "predicted_tokens_per_second": timing.get("tokens_per_second"),
                     "predicted_mfu": timing.get("mfu")})  # fmt: skip
    fitting = [r["size"] for r in rows if r["fits"]]
    timed = sorted((r for r in rows if r["fits"] and r["predicted_step_seconds"]),
                   key=lambda r: r["predicted_step_seconds"])  # fmt: skip
    result = {
        "plan": rows, "device": getattr(device, "device_kind", device.platform),
        "device_memory": memory, "batch": args.batch or 8, "remat": args.remat,
        "largest_that_fits": fitting[-1] if fitting else None,
        "fastest_predicted": [r["size"] for r in timed],
    }  # fmt: skip
    if memory is not None and not all(r["fits"] for r in rows) and args.device_memory is None:
        result["note"] = memory_limit_note(device)
    return result


def _strategy(args: argparse.Namespace) -> Any:
    """``dp`` with the add-ons and options the command line gave (``--addon offload -o
    offload.params=true``); the hand-written twin is always the plain step."""
    import shardplug

    options = {}
    for given in args.option:  # KEY=VALUE, checked by main
        key, _, value = given.partition("=")
        options[key] = {"true": True, "false": False}.get(value.lower(), value)
    return shardplug.get_strategy("dp", addons=args.addon, **options)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="125m")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--remat", choices=REMAT, default="none")
    parser.add_argument("--addon", action="append", default=[], help="an add-on (offload)")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an add-on's option, e.g. offload.params=true")  # fmt: skip
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="fine-tune low-rank adapters of this rank (the ratio: against "
                        "the hand-written full step)")  # fmt: skip
    parser.add_argument("--lora-quantize", default=None, choices=("int8", "int4", "nf4"),
                        help="with --lora: the frozen base quantized (QLoRA)")
    parser.add_argument("--plan", action="store_true", help="the largest size that fits")
    parser.add_argument("--target", default=None, metavar="GPU",
                        help="--plan for this GPU, compiled on this machine (h100, h200, a100; "
                        "JAX_PLATFORMS=cpu and shardplug[target])")  # fmt: skip
    parser.add_argument("--device-memory", type=float, default=None, help="bytes, for --plan")
    parser.add_argument("--sizes", default=",".join(n for n in SIZES if n != "smoke"),
                        help="the sizes --plan tries, smallest first")  # fmt: skip
    args = parser.parse_args(argv)
    unknown = [n for n in args.sizes.split(",") if n not in SIZES]
    if unknown:
        parser.error(f"--sizes: no size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    for given in args.option:
        if "=" not in given:
            parser.error(f"-o {given}: give KEY=VALUE, e.g. offload.params=true")
    if args.lora_quantize and args.lora is None:
        parser.error("--lora-quantize stores the base adapters train on: give --lora RANK too")
    if args.target and not args.plan:
        parser.error("--target plans for a GPU that is not here: give --plan too")
    if args.target:
        from shardplug.core.compiled.targets import on_cpu_alone

        on_cpu_alone()  # before JAX starts its backends
    if args.plan:
        result = _plan(args)
        print(json.dumps(result))
        return result

    import jax

    import shardplug
    from shardplug.core.flops import TransformerShape, product_dtypes, step_flops
    from shardplug.planning.explain import peak_bytes

    size = SIZES[args.size]
    batch = args.batch or size.batch
    t = task(args.size, batch, args.remat)
    if args.lora is not None:
        t = shardplug.with_lora(t, args.lora, quantize=args.lora_quantize)
    trainer = shardplug.Trainer(
        t.adapter, loss_fn=t.loss_fn, optimizer=t.optimizer, strategy=_strategy(args),
        devices=1, precision=args.precision, log_every=args.steps,
    )  # fmt: skip
    data = batches(size, batch)

    def feed(n):
        return (data[i % len(data)] for i in range(n))

    trainer.fit(feed(3), 3)  # compile and warm up
    device = trainer.mesh.devices.flat[0]
    measured = (device.memory_stats() or {}).get("peak_bytes_in_use")
    predicted = peak_bytes(trainer.compiled.memory_analysis())
    from shardplug.core.compiled.chips import chip_of

    chip = chip_of(device)  # a GPU shardplug predicts: the step's time from its own program
    predicted_step = shardplug.predict_step(trainer.compiled, chip).seconds if chip else None

    step, state, traced = hand_written(size, batch, args.remat)
    for b in feed(3):
        state, loss = step(state, b)
    jax.block_until_ready(loss)

    ours, theirs = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        trainer.fit(feed(args.steps), args.steps)
        ours.append((time.perf_counter() - start) / args.steps)
        start = time.perf_counter()
        for b in feed(args.steps):
            state, loss = step(state, b)
        jax.block_until_ready(loss)
        theirs.append((time.perf_counter() - start) / args.steps)
    mine, hand = statistics.median(ours), statistics.median(theirs)

    counted = TransformerShape(size.layers, size.width, size.sequence, size.vocab)
    per_token = counted.flops_per_token()["total"]
    tokens = batch * size.sequence
    kind = getattr(device, "device_kind", device.platform)
    peak = (args.peak_tflops * 1e12) if args.peak_tflops else next(
        (v for k, v in PEAKS.items() if k in kind), None
    )  # fmt: skip
    devices = trainer.mesh.size

    def figures(seconds: float, jaxpr: Any) -> dict[str, Any]:
        model = per_token * tokens / seconds
        return {
            "step_seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "model_tflops_per_second": model / 1e12,
            "hardware_tflops_per_second": step_flops(jaxpr) / seconds / 1e12,
            "mfu": None if peak is None else model / (peak * devices),
            "bf16_share": product_dtypes(jaxpr).share("bfloat16"),
        }

    result = {
        "size": args.size,
        "params": sum(x.size for x in jax.tree.leaves(trainer.state.params)),
        "device": kind,
        "devices": devices,
        "batch": batch,
        "sequence": size.sequence,
        "precision": args.precision,
        "remat": args.remat,
        "addons": args.addon,
        "options": args.option,
        "lora": args.lora,
        "lora_quantize": args.lora_quantize,
        "model_flops_per_token": per_token,
        "shardplug": figures(mine, trainer.jaxpr),
        "hand_written": figures(hand, traced.jaxpr),
        "ratio": mine / hand,
        "rounds": {"shardplug": ours, "hand_written": theirs},
        "predicted_peak_bytes": predicted,
        "measured_peak_bytes": measured,
        "predicted_step_seconds": predicted_step,
        "loss": trainer.history[-1]["loss"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import sys

    from shardplug.errors import ShardplugError

    try:
        main()
    except ShardplugError as exc:  # a bad GPU, add-on or option: one line, as the CLI says it
        sys.exit(print(f"gpu_mfu: error: {exc}", file=sys.stderr) or 2)
