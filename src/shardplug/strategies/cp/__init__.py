"""Context parallel over the `context` axis: the sequence split across devices.

Every batch leaf that is a sequence (its second dimension read by the model's attention,
token ids, or a leaf named by ``sequence="tokens,..."``) is split there over ``context`` in
contiguous blocks (one the devices do not divide is placed whole), and so is every
activation along it; parameters are replicated over ``context`` (an ``fsdp`` of the same
composition stores them split over it too, as torchtitan shards over dp_shard x cp).
Attention sees the whole sequence: cp supplies :func:`shardplug.attention`'s operation
(:mod:`.ring`), ring attention (the key/value blocks passed round ``context``;
``scheme="ring"``, the default by measurement), an attention whose keys and values are
all-gathered (``scheme="gather"``), all-to-all attention (``scheme="ulysses"``,
:mod:`.ulysses`: the heads split over ``context`` for attention, the sequences whole), or,
for heads that do not divide ``context``, the hybrid (``scheme="hybrid"``: all-to-alls
within groups of devices the heads divide, the ring across the groups).
``attention=`` is the older name of ``scheme=``. Causal, the ring deals each layer's blocks
zig-zag for its span and back (``balance="zigzag"``, the default), so every device computes the same
half of the causal work and skips the other; positions and targets are those of the sequence
as it is: nothing outside attention sees an order but the real one. Any length: attention
pads the sequence to whole blocks and masks the padding. A model that computes attention
otherwise is warned of once: it trains right, through the compiler's own gathers.
"""

from __future__ import annotations

import math
from typing import ClassVar

from shardplug.plugin import (
    RANK,
    Axis,
    Capability,
    ConfigError,
    Explained,
    Operations,
    StrategyOptionError,
    hookimpl,
    warn_once,
)
from shardplug.strategies.cp.ring import gathered_attention, ring_attention
from shardplug.strategies.cp.ulysses import ulysses_attention

SCHEMES = ("ring", "gather", "ulysses", "hybrid")


class ContextParallel:
    """Context parallel: the sequence split over `context`, ring attention over it."""

    unsupported: ClassVar[dict[str, str]] = {
        Capability.WITHOUT_SEQUENCE: "context parallelism splits the batch's sequence, and a "
        "model whose batch has none has nothing to split: leave cp out (a sequence the "
        "model's attention reads otherwise is named with -o cp.sequence=LEAF,...)",
        Capability.UNEVEN_SHAPES: "a model of two plain layers has no sequence",
        Capability.BATCH_SPLIT: "context parallelism alone splits the sequence, not the rows",
    }

    def __init__(self, scheme: str | None = None, balance: str = "zigzag", sequence: str = "",
                 attention: str | None = None):  # fmt: skip
        if scheme is not None and attention is not None and scheme != attention:
            raise StrategyOptionError(
                f"cp options scheme {scheme!r} and attention {attention!r}: attention is the "
                "older name of scheme; give one"
            )
        attention = scheme or attention or "ring"
        if attention not in SCHEMES:
            raise StrategyOptionError(
                f"cp option scheme must be 'ring' (keys and values passed round the ring), "
                f"'gather' (all-gathered), 'ulysses' (all-to-all: the heads split) or "
                f"'hybrid' (all-to-alls within groups the heads divide, a ring across them), "
                f"got {attention!r}"
            )
        if balance not in ("zigzag", "none"):
            raise StrategyOptionError(
                f"cp option balance must be 'zigzag' (the ring's causal work dealt evenly) or "
                f"'none' (every block pair computed, masked), got {balance!r}"
            )
        self.attention, self.balance = attention, balance
        # batch leaves the run declares sequences, beyond what the model's attention reads
        self.sequence = {p.strip() for p in str(sequence).split(",") if p.strip()}
        self._leaves: set[str] = set()  # every batch leaf laid out so far, to check those
        #: the sequences laid out, by leaf: their length and whether they split over context
        self._sequences: dict[str, tuple[int, bool]] = {}
        self._judged = False  # whether a program of the run was judged to divide the work
        self._ring_ran = False  # whether the last traced program went round the ring
        self._all_to_all: list[int] = []  # the last program's ulysses blocks, in bytes

    @hookimpl
    def parallel_axis(self):
        return Axis("context", rank=RANK["context"], logical=("length",), lends=True)

    @hookimpl
    def split_batch(self, path, shape, axis, size, sequence):
        self._leaves.add(path)
        if path in self.sequence:
            if len(shape) < 2:
                raise ConfigError(
                    f"cp option sequence names batch leaf {path!r}, of shape {tuple(shape)}: "
                    f"a sequence is a leaf's second dimension, and it has none"
                )
        elif sequence is False:
            return None  # no sequence (features, labels): whole over the context axis
        # a sequence the devices do not divide (tokens of L + 1 for a model fed
        # tokens[:, :-1]) is read whole by each of them: placing an array needs even
        # blocks, attention does not (it pads), and splits the activations from there
        self._sequences[path] = (shape[1], shape[1] % size == 0)
        return None if shape[1] % size else 1

    @hookimpl
    def operations(self, axis, mesh):
        unknown = sorted(self.sequence - self._leaves)
        if unknown and self._leaves:  # traced after the batch was laid out: a misspelling
            raise ConfigError(
                f"cp option sequence names {unknown[0]!r}, which is no leaf of the batch "
                f"({', '.join(sorted(self._leaves))}): name the leaves that hold a sequence"
            )
        if mesh.shape[axis] == 1:
            return None
        self._ring_ran = False
        # this program's sequences (laid out just before it is traced), for its own verdict
        sequences, self._sequences = self._sequences, {}

        def ran() -> None:
            self._ring_ran = True

        self._all_to_all = []
        if self.attention == "ring":
            ring = ring_attention(axis, self.balance == "zigzag", on_ring=ran)
        elif self.attention in ("ulysses", "hybrid"):
            ring = ulysses_attention(axis, lambda *a: self._all_to_all.append(a),
                                     hybrid=self.attention == "hybrid",
                                     balance=self.balance == "zigzag", on_ring=ran)  # fmt: skip
        else:
            ring = gathered_attention(axis)

        def attend(query, key, value, *, causal, bias, mask, scale, segment_ids=None):
            self._judged = True  # the sequence splits from here on: cp divides the work
            return ring(query, key, value, causal=causal, bias=bias, mask=mask, scale=scale,
                        segment_ids=segment_ids)  # fmt: skip

        return Operations(attention=attend, unused=lambda _: self._unused(axis, mesh, sequences))

    def _unused(self, axis: str, mesh, sequences: dict[str, tuple[int, bool]]) -> None:
        """The model never called :func:`shardplug.attention`: cp divides the sequence the
        batch gives split, and nothing at all where none is: refused, in one line, for the
        run's first program (its training step); a later one (an evaluation of other
        lengths) is told as below."""
        first, self._judged = not self._judged, True
        if first and not any(split for _, split in sequences.values()):
            size = mesh.shape[axis]
            found = ", ".join(f"{leaf} of {length}" for leaf, (length, _) in
                              sorted(sequences.items()))  # fmt: skip
            batch = (
                f"no sequence of the batch splits over its {size} devices ({found} positions, "
                f"which {size} do not divide: a model fed tokens[:, :-1] reads one fewer)"
                if found
                else "the batch holds no sequence it splits"
            )
            raise ConfigError(
                f"cp divides nothing here: {batch}, and the model never calls "
                f"shardplug.attention, which splits the activations from there: call "
                f"shardplug.attention(q, k, v, causal=True) in the model's attention, give "
                f"sequences a multiple of {size} long, or leave cp out"
            )
        said = (
            f"cp: the model never called shardplug.attention, so cp did not gather its keys "
            f"and values: attention written by hand (an einsum, or "
            f"jax.nn.dot_product_attention) still computes right over the sequence split on "
            f"{axis!r}, through whatever gathers the compiler chooses (explain shows them); "
            f"call shardplug.attention(q, k, v, causal=True) instead"
        )
        warn_once(said)

    @hookimpl
    def explain_step(self, axis, mesh, step):
        """How the sequence is split (positions per device) and what the ring sends, as a
        share of what the step sends."""
        split = [
            (leaf, sharding) for leaf, sharding in zip(step.batch, step.batch_shardings,
                                                       strict=True)
            if len(sharding.spec) > 1 and axis in _axes(sharding.spec[1])
        ]  # fmt: skip
        if not split:
            return None
        leaf, sharding = split[0]
        axes = _axes(sharding.spec[1])
        parts = math.prod(mesh.shape[a] for a in axes)
        length = leaf.shape[1]
        found = step.collectives
        ring = [c for c in found if c["kind"] == "collective-permute" and self._ring_ran]
        sent = sum(c["wire_bytes"] for c in found)
        ring_bytes = sum(c["wire_bytes"] for c in ring)
        report = {
            "axes": list(axes), "devices": parts, "length": length,
            "per_device": length // parts, "ring_permutes": sum(c["count"] for c in ring),
            "ring_bytes": ring_bytes, "ring_share": ring_bytes / sent if sent else 0.0,
        }  # fmt: skip
        how = (
            f"its attention's ring sends {report['ring_permutes']} collective-permutes, "
            f"{ring_bytes / 2**20:.1f} MiB per device per step ({report['ring_share']:.0%} of "
            f"what the step sends)"
            if ring
            else "its attention gathers the keys and values (all-gathers; no ring)"
        )
        if self.attention in ("ulysses", "hybrid") and self._all_to_all:
            a2a = [c for c in found if c["kind"] == "all-to-all"]
            # each block's (A-1)/A leaves its device (A: the devices of its all-to-all, C for
            # Ulysses alone), forward and again for the gradient: per attention the model's
            # code calls (a layer stack's, once for all its layers)
            textbook = sum(2 * b * (a - 1) // a for b, a in self._all_to_all)
            report.update(all_to_alls=sum(c["count"] for c in a2a),
                          all_to_all_bytes=sum(c["wire_bytes"] for c in a2a),
                          all_to_all_textbook_per_layer=textbook)  # fmt: skip
            share = "(C-1)/C" if self.attention == "ulysses" else "(A-1)/A, A the group's"
            how = (
                f"its attention's all-to-alls send {report['all_to_all_bytes'] / 2**20:.2f} "
                f"MiB per device per step ({report['all_to_alls']} of them); the textbook, "
                f"{textbook / 2**20:.3f} MiB a layer (its query, key, value and output "
                f"blocks, {share} of each, forward and backward)"
            ) + (f"; and {how}" if ring else "")
        note = (
            f"the sequence is split over {list(axes)}: each device holds {length // parts} of "
            f"the {length} positions of every row and every activation along them; {how}"
        )
        return Explained(name="sequence", report=report, notes=(note,))


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
