"""Pretrained checkpoints in Hugging Face's format: loaded straight into any layout, and
written back.

A checkpoint is a directory: ``config.json`` and safetensors (one file, or shards with
their ``model.safetensors.index.json``), as ``save_pretrained`` writes it. Llama (2, 3,
3.1/3.2), Mistral, Qwen2, Qwen3, Gemma 3 (text), Mixtral and Phi-3 load into the decoder of
:mod:`shardplug.pretrained.decoder`, in Flax NNX, Flax Linen or Equinox; each family is one
module of :mod:`shardplug.pretrained.families`::

    model = shardplug.pretrained.load("checkpoints/Llama-3.2-1B")
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.adamw(1e-5), strategy="fsdp")

Nothing is read until the trainer creates its state; then every device's block of every
parameter is read from the files (mapped, so only its bytes) and placed where the strategy
puts it: no host holds the whole model before it is sharded, and across processes each reads
only what its devices hold. :func:`export` writes the parameters back in the family's names
and shapes, one tensor at a time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardplug import moe
from shardplug.core.means import Mean
from shardplug.core.operations.attention import packed_inputs
from shardplug.core.sharding import leaf_paths
from shardplug.errors import ConfigError, PretrainedError
from shardplug.models import check_adapter
from shardplug.models.adapter import Adapter
from shardplug.pretrained import decoder
from shardplug.pretrained.config import DecoderConfig, Traits
from shardplug.pretrained.families import FAMILIES, read_config, tensors
from shardplug.pretrained.families.base import Family, Stored
from shardplug.pretrained.safetensors import INDEX, Tensors, write
from shardplug.pretrained.stored import (
    block_index,
    layout,
    made_back,
    parameters,
    pieces,
    shapes,
)

__all__ = ["FAMILIES", "DecoderConfig", "Family", "Pretrained", "Stored", "Traits", "export",
           "load", "parameters", "read_config", "tensors"]  # fmt: skip

CASTS = ("float32", "bfloat16", "float16")


def _canonical(path: str) -> str:
    """A framework's parameter path (``outer/embed``, ``params/layers_q``, ``arrays/layers/q``)
    as the decoder's name (``embed``, ``layers/q``)."""
    path = re.sub(r"^(params/|arrays/|outer/)", "", path)
    return re.sub(r"^layers_", "layers/", path)


def decoder_name(path: str) -> str:
    """A framework's parameter path as the decoder's name (``arrays/layers/q``: ``layers/q``)."""
    return _canonical(path)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A checkpoint on disk, checked and ready to load: its :class:`DecoderConfig`, the
    dtype its parameters will have, and the modules, adapters and loss to train it with."""

    directory: pathlib.Path
    config: DecoderConfig
    dtype: np.dtype
    #: the files' tensors; None for a directory with a config alone (planning only)
    tensors: Tensors | None = dataclasses.field(repr=False, compare=False)

    def module(self, framework: str = "nnx", *, remat: str = "none", seed: int = 0) -> Any:
        """A fresh module of this shape (random weights): NNX, Linen (unbound) or Equinox."""
        check_adapter(framework)
        dtype = jnp.dtype(self.dtype)
        if framework == "nnx":
            from flax import nnx

            return decoder.NnxDecoder(self.config, dtype=dtype, remat=remat, rngs=nnx.Rngs(seed))
        if framework == "linen":
            return decoder.LinenDecoder(self.config, dtype=dtype, remat=remat)
        return decoder.EqxDecoder(self.config, jax.random.key(seed), dtype=dtype, remat=remat)

    def adapter(self, framework: str = "nnx", *, remat: str = "none") -> Adapter:
        """The model in ``framework``, adapted, its parameters to be read from the checkpoint
        straight into the strategy's shardings when the trainer creates its state."""
        from shardplug.models import from_equinox, from_linen, from_nnx

        check_adapter(framework)
        c, dtype = self.config, jnp.dtype(self.dtype)
        if framework == "nnx":
            made = from_nnx(lambda rngs: decoder.NnxDecoder(c, dtype=dtype, remat=remat,
                                                            rngs=rngs))  # fmt: skip
        elif framework == "linen":
            made = from_linen(self.module("linen", remat=remat), jnp.zeros((1, 2), jnp.int32))
        else:
            made = from_equinox(
                lambda key: decoder.EqxDecoder(c, key, dtype=dtype, remat=remat),
                rules=decoder.eqx_rules(c),
            )
        made.weights = self.place
        return made

    def place(self, shardings: Any, each: Callable[[int, jax.Array], Any] | None = None) -> Any:
        """The parameters, read from the files into ``shardings`` (a tree of
        ``NamedSharding`` shaped like a framework's parameters): each device's block is
        read once (devices holding the same block share the read) and nothing else. With
        ``each``, ``each(i, leaf)`` stands for the ``i``-th leaf as soon as it is read (a
        QLoRA base quantizes each weight before the next is read)."""
        if self.tensors is None:
            raise PretrainedError(
                f"{self.directory}: no *.safetensors there: a config alone plans (explain, "
                "recommend) but has no weights to train from"
            )
        paths = leaf_paths(shardings)
        leaves = jax.tree.leaves(shardings)
        keep = each or (lambda _, leaf: leaf)
        made = [keep(i, self._leaf(_canonical(p), s))
                for i, (p, s) in enumerate(zip(paths, leaves, strict=True))]  # fmt: skip
        return jax.tree.unflatten(jax.tree.structure(shardings), made)

    def _leaf(self, name: str, sharding: Any) -> jax.Array:
        shape = parameters(self.config)[name][0]
        held = dict(pieces(self.config, name))
        transposed = tensors(self.config)[name].transposed
        lead = len(next(iter(held)))
        dtype = self.dtype
        read: dict[str, np.ndarray] = {}
        # how many of this process's devices hold each block: kept until the last has it
        indices = sharding.addressable_devices_indices_map(shape).values()
        uses = collections.Counter(map(repr, indices))

        def block(index: tuple[slice, ...]) -> np.ndarray:
            key = repr(index)
            uses[key] -= 1
            if key not in read:
                index = tuple(index) + (slice(None),) * (len(shape) - len(index))
                positions = [range(n)[i] for n, i in zip(shape[:lead], index[:lead], strict=True)]
                rest = block_index(self.config, name, shape, index, lead)

                def one(position):
                    part = self.tensors.read(held[position], rest)
                    return (part.T if transposed else part).astype(dtype, copy=False)

                if lead == 0:
                    read[key] = one(())
                elif lead == 1:
                    read[key] = np.stack([one((i,)) for i in positions[0]])
                else:
                    read[key] = np.stack([np.stack([one((i, e)) for e in positions[1]])
                                          for i in positions[0]])  # fmt: skip
            return read[key] if uses[key] else read.pop(key)  # kept while a device needs it

        return jax.make_array_from_callback(shape, sharding, block)

    def task(self, framework: str = "nnx", *, batch_size: int | None = None,
             sequence: int | None = None, seed: int = 0, learning_rate: float | None = None,
             remat: str = "none", text: str | None = None,
             tokenizer: str | pathlib.Path | None = None,
             optimizer: Any = None) -> Any:  # fmt: skip
        """Fine-tuning as a :class:`shardplug.Task` (AdamW at ``learning_rate``, 1e-4 unless
        given; or ``optimizer``, an optax transformation: :meth:`shardplug.Optimizer.build`).

        With ``text`` (a file, directory or glob: see :mod:`shardplug.pretrained.text`), on
        that text, tokenized by ``tokenizer`` (a directory with ``tokenizer.json``; by default
        the checkpoint's own) and packed into shuffled rows of ``sequence`` tokens (default
        1024, at most the model's positions). Without, on the reference transformer's
        synthetic token chain (64 tokens of the vocabulary; its loss can fall to 0.90 nats).
        """
        from shardplug.core.flops import TransformerShape
        from shardplug.models import synthetic
        from shardplug.running.data import Batches
        from shardplug.task import Task

        c = self.config
        size = batch_size or 8
        if text is not None:
            from shardplug.pretrained import text as text_

            length = sequence or min(1024, c.max_positions or 1024)
            tok = text_.read_tokenizer(tokenizer or self.directory, c.vocab)
            docs = text_.documents(text)
            eos = c.raw.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
            packed = text_.pack(docs, tok, length, eos, where=f"text:{text}")
            name = f"text-{len(docs)}docs-{len(packed.ids)}tokens-{length}"
            data = Batches(packed.dataset, size, seed=seed, name=name)
            model_reads = length
        else:
            if c.vocab < synthetic.VOCAB:
                raise PretrainedError(
                    f"{self.directory}: a vocabulary of {c.vocab} is smaller than the "
                    f"synthetic data's {synthetic.VOCAB} tokens"
                )
            length = sequence or synthetic.SEQ_LEN
            data = Batches(synthetic.records("markov", size, seed, sequence=length), size,
                           shuffle=False, name=f"markov-{seed}-{length}")  # fmt: skip
            model_reads = length  # as the reference transformer counts it
        shape = TransformerShape(layers=c.layers, width=c.width, sequence=model_reads,
                                 vocab=c.vocab, mlp=c.mlp, mlp_matrices=3, experts=c.experts,
                                 top_k=c.top_k or 1)  # fmt: skip
        return Task(
            adapter=self.adapter(framework, remat=remat),
            loss_fn=self.loss_fn,
            optimizer=optimizer or optax.adamw(learning_rate or 1e-4),
            data=data,
            name=f"{c.family}:{self.directory.name}",
            flops_per_sample=shape.flops_per_token()["total"] * model_reads,
        )

    def loss_fn(self, model: Any, batch: dict[str, Any]):
        """Next-token cross-entropy: the model reads ``tokens[:, :-1]`` and is scored on
        ``tokens[:, 1:]`` (or reads ``tokens`` and is scored on ``targets`` when the batch
        has them); positions where ``batch["loss_mask"]`` is 0 do not count; a
        mixture of experts adds its balancing loss at the config's ``router_aux_loss_coef``."""
        tokens, targets = batch["tokens"], batch.get("targets")
        if targets is None:  # next-token: the model reads all but the last
            tokens, targets = tokens[:, :-1], tokens[:, 1:]
        out = model(tokens, **packed_inputs(batch, tokens.shape[1]))
        logits, tallies = out if isinstance(out, tuple) else (out, None)
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), targets
        )
        mask = batch.get("loss_mask")
        if mask is None:
            loss = losses.mean()
        else:  # a sum and a count: exact wherever the step cuts the batch
            mask = mask[:, -targets.shape[1] :].astype(jnp.float32)
            loss = Mean((losses * mask).sum(), mask.sum())
        metrics = {"lm_loss": loss}
        if tallies is not None:
            summary = moe.summary(tallies)
            metrics.update(summary)
            aux = self.config.router_aux_loss * summary["moe_balance_loss"]
            # with a mask, each token's share of the balancing loss: aux once divided
            loss = loss + aux if mask is None else Mean(loss.total + aux * loss.count,
                                                        loss.count)  # fmt: skip
        return loss, metrics


def _cast_to(dtype: Any, stored: np.dtype, where: pathlib.Path) -> np.dtype:
    if dtype is None:
        return stored
    name = str(jnp.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in CASTS:
        raise PretrainedError(
            f"{where}: cannot cast the parameters to {name}; ask for one of {', '.join(CASTS)}"
        )
    return np.dtype(jnp.dtype(name))


def load(directory: str | pathlib.Path, *, dtype: Any = None) -> Pretrained:
    """Check a checkpoint directory and ready it to load: its config read, every tensor the
    config implies present with the shape it implies. ``dtype`` (``float32``, ``bfloat16``,
    ``float16``) casts the parameters; by default they keep the dtype they are stored in."""
    if not isinstance(directory, str | os.PathLike):
        raise PretrainedError(f"pretrained.load({directory!r}): give the checkpoint's directory "
                              "as a path (str or pathlib.Path)")  # fmt: skip
    where = pathlib.Path(directory)
    config = read_config(where)
    if not any(where.glob("*.safetensors")) and not (where / INDEX).is_file():
        stored_as = np.dtype(jnp.dtype(config.dtype)) if config.dtype in CASTS else np.float32
        return Pretrained(where, config, _cast_to(dtype, np.dtype(stored_as), where), None)
    files = Tensors(where)
    stored: set[np.dtype] = set()
    for tensor, want in shapes(config).items():
        if tensor not in files:
            raise PretrainedError(
                f"{where}: no tensor {tensor} in the checkpoint, which a {config.family} "
                f"of this config has; is the directory complete?"
            )
        if files.shape(tensor) != tuple(want):
            raise PretrainedError(
                f"{where}: tensor {tensor} has shape {files.shape(tensor)}, but "
                f"config.json implies {tuple(want)}"
            )
        stored.add(files.dtype(tensor))
    floats = [d for d in stored if jnp.issubdtype(d, jnp.floating)]
    if len(floats) != len(stored):
        raise PretrainedError(f"{where}: tensors stored as {sorted(map(str, stored))}: "
                              "only floating-point checkpoints load")  # fmt: skip
    kept = max(floats, key=lambda d: d.itemsize) if floats else np.dtype("float32")
    return Pretrained(where, config, _cast_to(dtype, kept, where), files)


def export(params: Any, pretrained: Pretrained | DecoderConfig, directory: str | pathlib.Path,
           *, dtype: Any = None) -> pathlib.Path:  # fmt: skip
    """Write ``params`` (a framework's parameter tree, e.g. ``trainer.state.params``) as a
    checkpoint of the family: ``config.json`` and ``model.safetensors`` with its tensor
    names and shapes, loadable by the reference implementation. Each tensor is gathered
    alone (one whole tensor on the host at a time); in a multi-process run every process
    takes part and process 0 writes."""
    leaves = dict(zip(map(_canonical, leaf_paths(params)), jax.tree.leaves(params), strict=True))
    return _write(leaves, pretrained, directory, dtype, _gathered)


def export_checkpoint(checkpoint_dir: str | pathlib.Path, directory: str | pathlib.Path, *,
                      init_from: str | pathlib.Path | None = None, step: int | None = None,
                      dtype: Any = None,
                      merge: bool = False) -> tuple[int, DecoderConfig]:  # fmt: skip
    """Write a training checkpoint's parameters (``shardplug train --init-from``'s) as a
    checkpoint of the family its run started from (``init_from``, by default the one the run
    recorded). The training checkpoint is read one parameter at a time (the optimizer's
    state not at all), so the host holds at most one parameter, all its layers, whole (or
    the few a fused tensor holds, such as Phi-3's q, k and v). A run that trained low-rank
    adapters (``--lora``) is written with them merged into its weights (``merge``, which it
    needs). Returns the step written and the family's config."""
    from shardplug.running.checkpoint import Checkpoints

    checkpoints = Checkpoints(checkpoint_dir, read_only=True)
    step, meta = checkpoints.read_meta_of(step)
    recorded = meta.get("config", {}).get("init_from")
    init_from = init_from or recorded
    if init_from is None:
        raise ConfigError(
            f"{checkpoint_dir}: the run did not start --init-from a pretrained checkpoint; "
            "give --init-from DIR, the checkpoint whose config it has"
        )
    config = read_config(init_from)
    started = config.family
    if recorded and pathlib.Path(recorded) != pathlib.Path(init_from):
        with contextlib.suppress(PretrainedError, ConfigError, OSError):  # gone: not checked
            started = read_config(recorded).family
    if started != config.family:  # the same shapes can be another architecture's
        raise ConfigError(
            f"--init-from {init_from} is a {config.family} checkpoint, and the run started "
            f"from {recorded}, a {started}: export with a {started} config"
        )
    from shardplug.pretrained import peft

    adapters = peft.of_run(meta.get("config", {}))
    if adapters and not merge:
        raise ConfigError(
            f"{checkpoint_dir}: the run trained low-rank adapters (--lora {adapters[0]}): give "
            "--merge to write them merged into the base's weights"
        )
    if merge and not adapters:
        raise ConfigError(f"--merge: {checkpoint_dir}'s run trained no adapters (no --lora)")
    from shardplug.pretrained.checkpointed import Lazy, merged

    if merge:
        base = None  # a run whose checkpoints hold the adapters alone: its base read again
        if meta.get("frozen"):
            base = load(init_from, dtype=meta.get("config", {}).get("param_dtype"))
        stored = merged(checkpoints, step, meta, adapters[1], adapters[0], base, _canonical)
    else:
        stored = {_canonical(n.removeprefix("params/")): Lazy(checkpoints, step, n, meta)
                  for n in meta["arrays"] if n.startswith("params/")}  # fmt: skip
    for name, lazy in stored.items():
        lazy.uses = len(pieces(config, name)) if name in tensors(config) else 0
    _write(stored, config, directory, dtype, lambda array: array)
    return step, config


def _write(
    leaves: dict[str, Any], pretrained: Pretrained | DecoderConfig,
    directory: str | pathlib.Path, dtype: Any, source: Callable,
) -> pathlib.Path:  # fmt: skip
    config = pretrained.config if isinstance(pretrained, Pretrained) else pretrained
    out = pathlib.Path(directory)
    expected = parameters(config)
    unknown = sorted(set(leaves) - set(expected))
    missing = sorted(set(expected) - set(leaves))
    if unknown or missing:
        raise ConfigError(
            f"export: {(unknown or missing)[0]} is {'not a parameter' if unknown else 'missing'}"
            f" of the {config.family} decoder: export the parameters of a model "
            "pretrained.load made, with that checkpoint's config"
        )
    for name, (want, _) in expected.items():
        have = getattr(leaves[name], "shape", None)
        if have is not None and tuple(have) != tuple(want):
            raise ConfigError(
                f"export: {name} has shape {tuple(have)}, where the {config.family} config "
                f"implies {tuple(want)}: export with the config of the checkpoint the run "
                "started from (--init-from)"
            )
    if (out / "config.json").exists() or any(out.glob("*.safetensors")):
        raise ConfigError(f"{out} already holds a checkpoint: choose another directory")
    sources = {name: source(leaves[name]) for name in expected}
    entries: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]] = []
    whole = shapes(config)
    for tensor, held in layout(config).items():
        first = leaves[held[0][0]]
        kind = np.dtype(jnp.dtype(dtype or getattr(first, "dtype", None) or config.dtype))
        entries.append((tensor, whole[tensor], kind,
                        made_back(config, held, sources.__getitem__)))  # fmt: skip
    if jax.process_index() != 0:  # every process gathers each tensor with the others
        for entry in entries:
            entry[3]()
        return out
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "model.safetensors.partial"
    try:
        write(partial, entries)
    except BaseException:
        partial.unlink(missing_ok=True)
        if made:  # an output is written whole or not at all: no empty folder left
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    partial.rename(out / "model.safetensors")
    raw = dict(config.raw)
    raw.pop("torch_dtype", None)
    raw["dtype"] = str(entries[0][2])
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def _gathered(leaf: jax.Array) -> Any:
    """Slices of a (possibly sharded, possibly multi-process) array, each gathered whole."""

    class Gather:
        def __getitem__(self, position: tuple[int, ...]) -> np.ndarray:
            part = leaf[position] if position else leaf
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                return np.asarray(multihost_utils.process_allgather(part, tiled=True))
            return np.asarray(jax.device_get(part))

    return Gather()
