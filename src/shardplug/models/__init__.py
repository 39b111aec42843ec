"""Adapters for the model frameworks, and the reference models with their data.

A reference model is a name (``mlp``, ``classifier``, ``transformer``, ``cnn``) bound to a
model in each framework, a loss that works with any of them, and an endless synthetic data
set whose loss can truly fall.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardplug import moe
from shardplug.core.flops import TransformerShape
from shardplug.core.operations.attention import packed_inputs
from shardplug.core.operations.remat import REMAT_POLICIES
from shardplug.errors import ConfigError, UnknownModelError
from shardplug.models import equinox_models, linen_models, nnx_models, synthetic
from shardplug.models.adapter import Adapter, Rules, apply_rules
from shardplug.models.equinox_adapter import from_equinox
from shardplug.models.linen_adapter import from_linen
from shardplug.models.nnx_adapter import from_nnx

ADAPTERS = ("nnx", "linen", "equinox")


def _forward(model: Any, x: jax.Array, rng: jax.Array, train: bool, state: Any,
             packed: dict[str, jax.Array] | None = None):  # fmt: skip
    """Call a reference model of any framework; ``(output, new_state or None)``; ``packed``:
    packed documents' ``segment_ids`` and ``positions``, for the transformer."""
    packed = packed or {}
    if isinstance(model, nnx.Module):
        return model(x, **packed), None  # dropout keys and train/eval live in the module
    if isinstance(model, nn.Module):  # bound: batch_stats and rngs are in the binding
        return model(x, train=train, **packed), None
    if state is not None:
        return model(x, state, key=rng, inference=not train, **packed)
    return model(x, key=rng, inference=not train, **packed), None


def _mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2), {}


def _cross_entropy(out, batch):
    labels = batch["label"] if "label" in batch else batch["targets"]
    loss = optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
    if "targets" in batch:
        return loss, {}
    return loss, {"accuracy": jnp.mean(jnp.argmax(out, axis=-1) == labels)}


#: the weights of a mixture of experts' load-balancing loss (Switch Transformer's) and router
#: z-loss (ST-MoE's) in the reference transformer's loss
BALANCE_WEIGHT, Z_WEIGHT = 0.01, 0.001


@dataclasses.dataclass(frozen=True)
class ReferenceModel:
    """A built-in model: how to build it in each framework, its loss and its data."""

    name: str
    description: str
    builders: dict[str, Callable[[], Adapter]]
    inputs: str
    head: Callable[[jax.Array, dict], tuple[jax.Array, dict]]
    batches: Callable[..., Iterator[dict[str, Any]]]
    learning_rate: float
    batch_size: int = 64
    #: the options its builders take (the transformer's ``layers`` and ``remat``)
    options: tuple[str, ...] = ()

    def adapter(self, framework: str = "nnx", **options: Any) -> Adapter:
        """This model in ``framework`` (``nnx``, ``linen`` or ``equinox``), adapted.

        The transformer takes ``layers`` (its depth, default 2), ``remat`` (``none``,
        ``dots``, ``full`` or ``offload``: what each block recomputes in the backward pass) and
        ``sequence`` (its length, default 32: the position table and the data).
        """
        check_adapter(framework)
        given = {k: v for k, v in options.items() if v is not None}
        self.check_options(**given)
        return self.builders[framework](**given)

    @property
    def default_sequence(self) -> int | None:
        """The sequence it trains on unless ``sequence`` is given (None: it reads none)."""
        return synthetic.SEQ_LEN if "sequence" in self.options else None

    def flops_per_sample(self, **options: Any) -> float | None:
        """Training FLOPs of one sample as MFU counts them (:mod:`shardplug.core.flops`): the
        transformer's; None for the models that are not transformers."""
        if self.name != "transformer":
            return None
        sequence = options.get("sequence") or synthetic.SEQ_LEN
        shape = TransformerShape(
            layers=options.get("layers") or nnx_models.LAYERS, width=nnx_models.EMBED,
            sequence=sequence, vocab=synthetic.VOCAB, mlp=nnx_models.HIDDEN,
            experts=options.get("experts") or 0, top_k=options.get("top_k") or 2,
        )  # fmt: skip
        return shape.flops_per_token()["total"] * sequence

    def task(
        self,
        framework: str = "nnx",
        *,
        batch_size: int | None = None,
        seed: int = 0,
        learning_rate: float | None = None,
        optimizer: Any = None,
        **options: Any,
    ) -> Any:
        """This model as a :class:`shardplug.Task`: Adam at ``learning_rate`` (or
        ``optimizer``, an optax transformation: :meth:`shardplug.Optimizer.build`), and its
        synthetic data through Grain (:class:`shardplug.running.data.Batches`, the same batches as
        :attr:`batches`), with four held-out batches of another seed."""
        from shardplug.running.data import Batches
        from shardplug.task import Task

        size = batch_size or self.batch_size
        kind = self.batches.__name__
        held_out = seed + 1_000_003
        length = {"sequence": options["sequence"]} if options.get("sequence") else {}
        batches = functools.partial(self.batches, **length)
        return Task(
            adapter=self.adapter(framework, **options),
            loss_fn=self.loss_fn,
            optimizer=optimizer or optax.adam(learning_rate or self.learning_rate),
            data=Batches(
                synthetic.records(kind, size, seed, **length),
                size,
                shuffle=False,
                name=f"{kind}-{seed}" + (f"-{length['sequence']}" if length else ""),
            ),
            eval_data=lambda: itertools.islice(batches(size, held_out), 4),
            name=self.name,
            flops_per_sample=self.flops_per_sample(**options),
        )

    def check_options(self, **options: Any) -> None:
        """Raise :class:`ConfigError` for an option this model does not take or a bad value."""
        for key, value in options.items():
            if value is None:
                continue
            if key not in self.options:
                takes = ", ".join(self.options) or "none"
                raise ConfigError(
                    f"model {self.name!r} takes no option {key!r} (it takes: {takes}); "
                    f"the transformer has layers, remat, sequence, experts, top_k, "
                    f"capacity_factor, capacity_groups and bias_rate"
                )
            if key in ("layers", "sequence", "experts", "top_k", "capacity_groups") and (
                not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"{key} must be a positive integer, got {value!r}")
            if key in ("capacity_factor", "bias_rate") and not (
                isinstance(value, (int, float)) and value > 0
            ):
                raise ConfigError(f"{key} must be a positive number, got {value!r}")
            if key == "remat" and value not in REMAT_POLICIES:
                raise ConfigError(
                    f"remat must be one of {', '.join(REMAT_POLICIES)}, got {value!r}"
                )
        experts = options.get("experts")
        if experts is None and any(
            options.get(k) for k in ("top_k", "capacity_factor", "capacity_groups", "bias_rate")
        ):
            raise ConfigError(
                "top_k, capacity_factor, capacity_groups and bias_rate route among experts: "
                "give experts too"
            )
        if options.get("capacity_groups") and not options.get("capacity_factor"):
            raise ConfigError("capacity_groups counts capacity: give capacity_factor too")
        if experts is not None and (options.get("top_k") or 2) > experts:
            raise ConfigError(
                f"top_k {options.get('top_k') or 2} is more than the {experts} experts: each "
                f"token goes to top_k distinct experts (top_k <= experts)"
            )

    def loss_fn(
        self,
        model: Any,
        batch: dict,
        rng: jax.Array | None = None,
        train: bool = True,
        state: Any = None,
    ):
        """The loss for this model in any framework: ``(loss, metrics[, new_state])``."""
        packed = {}
        if self.inputs == "tokens":  # packed documents: ids and places, one a token read
            packed = packed_inputs(batch, batch["tokens"].shape[1])
        out, new_state = _forward(model, batch[self.inputs], rng, train, state, packed)
        out, *aux = out if isinstance(out, tuple) else (out,)
        loss, metrics = self.head(out.astype(jnp.float32), batch)  # the loss in float32
        if aux:  # a mixture of experts: its losses, each layer's on average (and its bias)
            mean = moe.summary(aux[0])
            loss = loss + BALANCE_WEIGHT * mean["moe_balance_loss"]
            loss = loss + Z_WEIGHT * mean["moe_z_loss"]
            if len(aux) > 1:  # how far apart the biases have moved, on average over layers
                mean["router_bias"] = jnp.mean(aux[1].max(-1) - aux[1].min(-1))
            metrics = {**metrics, **mean}
        return (loss, metrics) if new_state is None else (loss, metrics, new_state)


TRANSFORMER_OPTIONS = ("layers", "remat", "sequence", "experts", "top_k", "capacity_factor",
                       "capacity_groups", "bias_rate")  # fmt: skip


def _reference(name, description, nnx_build, linen_module, eqx_build, eqx_rules, **kwargs):
    """A reference model; builders given as functions of its options return the model."""
    takes = kwargs.get("options", ())

    def made(build, options):
        return build(**options) if takes else build

    builders = {
        "nnx": lambda **o: from_nnx(made(nnx_build, o)),
        "linen": lambda **o: from_linen(
            made(linen_module, o), linen_models.sample_input(name, o.get("sequence"))
        ),
        "equinox": lambda **o: from_equinox(
            made(eqx_build, o), rules=eqx_rules(**o) if callable(eqx_rules) else eqx_rules
        ),
    }
    return ReferenceModel(name, description, builders, **kwargs)


MODELS: dict[str, ReferenceModel] = {
    m.name: m
    for m in (
        _reference(
            "mlp",
            "MLP regressor of y = sum(x^2) + noise",
            nnx_models.regressor,
            linen_models.MODULES["mlp"],
            equinox_models.regressor,
            equinox_models.MLP_RULES,
            inputs="x",
            head=_mse,
            batches=synthetic.regression,
            learning_rate=3e-3,
        ),
        _reference(
            "classifier",
            "MLP classifier of 10 Gaussian clusters, with accuracy",
            nnx_models.classifier,
            linen_models.MODULES["classifier"],
            equinox_models.classifier,
            equinox_models.MLP_RULES,
            inputs="x",
            head=_cross_entropy,
            batches=synthetic.clusters,
            learning_rate=3e-3,
        ),
        _reference(
            "transformer",
            "decoder-only transformer LM on a sparse Markov chain",
            nnx_models.transformer,
            linen_models.TransformerLM,
            equinox_models.transformer,
            equinox_models.transformer_rules,
            inputs="tokens",
            head=_cross_entropy,
            batches=synthetic.markov,
            learning_rate=3e-3,
            batch_size=32,
            options=TRANSFORMER_OPTIONS,
        ),
        _reference(
            "cnn",
            "CNN with BatchNorm and dropout classifying 8x8 images of bars",
            nnx_models.cnn,
            linen_models.MODULES["cnn"],
            equinox_models.cnn,
            equinox_models.CNN_RULES,
            inputs="image",
            head=_cross_entropy,
            batches=synthetic.bars,
            learning_rate=3e-3,
        ),
    )
}


def get_model(name: str) -> ReferenceModel:
    """The reference model called ``name``."""
    if name not in MODELS:
        raise UnknownModelError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def check_adapter(name: str) -> None:
    """Raise :class:`UnknownModelError` unless ``name`` is a known adapter."""
    if name not in ADAPTERS:
        raise UnknownModelError(f"unknown adapter {name!r}; available: {', '.join(ADAPTERS)}")


__all__ = [
    "ADAPTERS",
    "MODELS",
    "Adapter",
    "ReferenceModel",
    "Rules",
    "apply_rules",
    "check_adapter",
    "from_equinox",
    "from_linen",
    "from_nnx",
    "get_model",
]
