"""The user's text, tokenized by the checkpoint's own tokenizer and packed into rows to
fine-tune on.

``--data text:FILE_OR_GLOB``: each ``.jsonl`` file holds one document per line (its
``"text"``); any other file is one document. Files are read in name order. Each document is
encoded by the tokenizer (``tokenizer.json``, through the ``tokenizers`` package, with its
special tokens: Llama's ``<s>``, Qwen's none) and ended by the config's ``eos_token_id``; the
documents are concatenated and cut into rows of ``sequence + 1`` tokens that overlap by one,
so that every token is predicted once. Each document is on its own, as if it had a row to
itself: a target that begins a new document (predicted from the end of the one before) does
not count (``loss_mask``), each token carries its document's id (``segment_ids``) so that
attention reaches no other document, and its position within its document (``positions``),
from which the model's positions restart at each document. The rows
are a Grain ``MapDataset``, shuffled per epoch by :class:`shardplug.running.data.Batches`, whose
position goes into every checkpoint: a resumed run reads the rows the uninterrupted one
would have. The whole corpus is tokenized when the run starts and held as int32 ids
(4 bytes a token) on each host.
"""

from __future__ import annotations

import glob
import json
import pathlib
from typing import Any

import grain
import numpy as np

from shardplug.errors import PretrainedError

__all__ = ["Packed", "documents", "pack", "read_tokenizer"]


def documents(pattern: str) -> list[str]:
    """The documents of the files ``pattern`` names (a file, a directory or a glob)."""
    where = pathlib.Path(pattern)
    if where.is_dir():
        paths = sorted(p for p in where.iterdir() if p.is_file())
    else:
        paths = sorted(pathlib.Path(p) for p in glob.glob(pattern, recursive=True)
                       if pathlib.Path(p).is_file())  # fmt: skip
    if not paths:
        raise PretrainedError(f"text:{pattern}: no files there; give a file, a directory or a glob")
    out: list[str] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PretrainedError(f"{path}: not readable as UTF-8 text ({e})") from None
        if path.suffix != ".jsonl":
            out.append(text)
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                found = record["text"]
            except (ValueError, KeyError, TypeError):
                raise PretrainedError(
                    f"{path}:{number}: each line of a .jsonl file is a JSON object with a "
                    '"text" field'
                ) from None
            if not isinstance(found, str):
                raise PretrainedError(f'{path}:{number}: its "text" is {found!r}; a document '
                                      "is a string")  # fmt: skip
            out.append(found)
    if not any(doc.strip() for doc in out):
        raise PretrainedError(f"text:{pattern}: no text in its files (only blank lines); give "
                              "documents to train on")  # fmt: skip
    return out


def read_tokenizer(directory: str | pathlib.Path, vocab: int) -> Any:
    """The ``tokenizers.Tokenizer`` in ``directory/tokenizer.json``, checked against a model
    of ``vocab`` tokens (a model's vocabulary may be padded past its tokenizer's, never the
    other way)."""
    import tokenizers

    path = pathlib.Path(directory)
    path = path if path.suffix == ".json" else path / "tokenizer.json"
    if not path.is_file():
        raise PretrainedError(
            f"{path}: no tokenizer there; give --tokenizer DIR, a directory with the "
            "checkpoint's tokenizer.json"
        )
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a bare Exception on a bad file
        raise PretrainedError(
            f"{path}: not a tokenizer the tokenizers package reads ({e})"
        ) from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab:
        raise PretrainedError(
            f"{path}: the tokenizer has {size} tokens but the model's vocabulary is {vocab}: "
            "it is not this checkpoint's tokenizer; give --tokenizer the checkpoint's own"
        )
    return tok


class Packed:
    """The rows of packed documents: ``Packed(...)[i]`` is ``{"tokens": (sequence + 1,),
    "loss_mask", "segment_ids", "positions": (sequence,)}`` (the last two of the tokens the
    model reads: each one's document, numbered from 0 in the row, and its place in it);
    :attr:`dataset` is the rows as a Grain ``MapDataset``."""

    def __init__(self, ids: np.ndarray, owner: np.ndarray, sequence: int):
        self.ids, self.owner, self.sequence = ids, owner, sequence
        self.rows = (len(ids) - 1) // sequence
        starts = np.flatnonzero(np.diff(owner, prepend=-1)) if len(owner) else owner
        first = np.repeat(starts, np.diff(np.append(starts, len(owner))))
        self.place = (np.arange(len(owner)) - first).astype(np.int32)  # within its document

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, row: int) -> dict[str, np.ndarray]:
        start = row * self.sequence
        window = slice(start, start + self.sequence + 1)
        owner = self.owner[window]
        return {"tokens": self.ids[window],
                "loss_mask": (owner[1:] == owner[:-1]).astype(np.int32),
                "segment_ids": (owner[:-1] - owner[0]).astype(np.int32),
                "positions": self.place[window][:-1]}  # fmt: skip

    @property
    def dataset(self) -> grain.MapDataset:
        return grain.MapDataset.range(self.rows).map(self.__getitem__)


def pack(docs: list[str], tokenizer: Any, sequence: int, eos: int | None,
         where: str = "text") -> Packed:  # fmt: skip
    """``docs`` encoded (the tokenizer's special tokens added), each ended by ``eos``,
    concatenated, in rows of ``sequence + 1`` tokens."""
    ids: list[np.ndarray] = []
    owner: list[np.ndarray] = []
    chunk = 1024  # encode_batch runs the Rust tokenizer on every core
    for first in range(0, len(docs), chunk):
        for n, encoding in enumerate(tokenizer.encode_batch(docs[first : first + chunk])):
            piece = encoding.ids + ([] if eos is None else [eos])
            ids.append(np.asarray(piece, np.int32))
            owner.append(np.full(len(piece), first + n, np.int32))
    stream = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    packed = Packed(stream, np.concatenate(owner) if owner else stream, sequence)
    if len(packed) == 0:
        raise PretrainedError(
            f"{where}: {len(stream)} tokens, fewer than one row of {sequence + 1}: give more "
            "text or a shorter --sequence"
        )
    return packed
