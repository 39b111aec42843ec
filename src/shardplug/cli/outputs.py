"""What ``train`` writes as it runs and when it ends: the metrics file, TensorBoard's
events, the progress bar (one callback for all three), and the summary line."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardplug.cli.config import RunConfig
from shardplug.cli.watch import Progress
from shardplug.errors import ConfigError


@contextlib.contextmanager
def logged(config: RunConfig, start: int, primary: bool) -> Iterator[Any]:
    """The callback ``fit`` hands its rows to: into ``--metrics-out``, ``--tensorboard`` and
    the progress bar (process 0 alone writes them); ``.evaluating`` wraps held-out data."""
    out = board = None
    if primary and config.metrics_out is not None:
        out = _Metrics(config.metrics_out, resume_from=start if config.resume else None)
    try:
        board = _tensorboard(config.tensorboard) if primary and config.tensorboard else None
        with Progress(config.quiet or not primary, config.steps, start) as advance:

            restart = os.environ.get("SHARDPLUG_RESTART") if config.resume else None

            def log(rows: list[dict[str, float]]) -> None:
                nonlocal restart
                if restart and rows:  # the first row after launch restarted the job
                    rows = [{**rows[0], "restart": int(restart)}, *rows[1:]]
                    restart = None
                if out is not None:
                    out.write(rows)
                if board is not None:
                    for row in rows:
                        for key, value in row.items():
                            if key != "step":
                                board.add_scalar(key, value, int(row["step"]))
                    board.flush()
                advance(rows)

            log.evaluating = advance.evaluating  # type: ignore[attr-defined]
            yield log
    finally:
        if out is not None:
            out.close()
        if board is not None:
            board.close()


def summary(config: RunConfig, task: Any, trainer: Any, history: list[dict[str, float]],
            start: int, samples: int, processes: int) -> str:  # fmt: skip
    """The line that ends a run: what trained, where, how fast, what was saved."""
    from shardplug.core.mesh import describe

    device = trainer.mesh.devices.flat[0].platform
    timed = [r for r in history[min(config.log_every, len(history) - 1) :] if not r.get("skipped")]
    timed = timed or history
    step_ms = 1000 * sum(r["step_time"] for r in timed) / len(timed)
    resumed = f" from step {start}" if start else ""
    saved_to = f"; saved {trainer.last_checkpoint}" if trainer.checkpoints is not None else ""
    in_processes = f" in {processes} processes" if processes > 1 else ""
    extras = f" in {config.grad_accum} microbatches" if config.grad_accum > 1 else ""
    extras += ", bf16" if trainer.precision in ("bf16", "bfloat16") else ""
    flops = sum(r.get("model_tflops", 0.0) for r in timed) / len(timed)
    rate = f", {flops * 1e3:.2f} model GFLOP/s" if flops else ""
    mfu = [r["mfu"] for r in timed if "mfu" in r]
    rate += f", MFU {100 * sum(mfu) / len(mfu):.1f}%" if mfu else ""
    held_out = [r for r in history if "eval_loss" in r]
    if held_out:
        rate += "; held out: " + ", ".join(
            f"{k[5:]} {v:.4f}"
            for k, v in held_out[-1].items()
            if k.startswith("eval_") and k != "eval_batches"
        )
    if trainer.settings.on_nonfinite == "skip" and trainer.skipped_steps:
        rate += (f"; skipped {trainer.skipped_steps} of {trainer.step} steps whose loss or "
                 "gradient was not finite")  # fmt: skip
    if config.profile_dir is not None:
        window, end = trainer.settings.profile_steps, trainer.step
        if start <= window.start < end:
            where = config.profile_dir / "process_<i>" if processes > 1 else config.profile_dir
            saved_to += f"; profile of steps {window.start}-{min(window.stop, end) - 1} in {where}"
        else:
            saved_to += (f"; no profile: its steps {window.start}-{window.stop - 1} were not "
                         f"run (this run ran {start}-{end - 1}; --profile-steps)")  # fmt: skip
    addons = f" + {', '.join(config.addon)}" if config.addon else ""
    return (
        f"shardplug: trained {task.name} ({task.adapter.framework}) with "
        f"{trainer.strategy.info.name if config.strategy is None else config.strategy}"
        f"{addons} on {trainer.mesh.size} {device} devices{in_processes} "
        f"({describe(trainer.mesh)}, {trainer.axis_types} axes), "
        f"batch {samples}{extras}: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} "
        f"in {len(history)} steps{resumed}; compile {trainer.compile_seconds:.1f} s, "
        f"{step_ms:.1f} ms/step, {samples / step_ms * 1000:.0f} samples/s{rate}{saved_to}"
    )


def plot(config: RunConfig, task: Any, history: list[dict[str, float]]) -> str:
    """``--plot``: the whole run's rows (the metrics file holds a resumed run's)."""
    from shardplug.cli.tools import plot_losses

    rows = history
    if config.metrics_out is not None and config.metrics_out.is_file():
        rows = [json.loads(line) for line in config.metrics_out.read_text().splitlines()]
    return f"shardplug: drew the losses in {plot_losses(rows, config.plot, task.name)}"


def _finite(row: dict[str, float]) -> dict[str, float | None]:
    return {k: v if math.isfinite(v) else None for k, v in row.items()}


def _tensorboard(directory: Path) -> Any:
    """A TensorBoard event writer (tensorboardX) into ``directory``."""
    from tensorboardX import SummaryWriter

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot write --tensorboard {directory}: {exc.strerror}") from None
    return SummaryWriter(str(directory))


class _Metrics:
    """The --metrics-out file, rewritten when the run logs its first rows, not before: a run
    refused once training starts (another data set, other batch shapes: refusals that come
    in ``fit``) leaves it as it was. Whether it can be written is checked now, changing
    nothing."""

    def __init__(self, path: Path, resume_from: int | None):
        self.path, self.resume_from, self.file = path, resume_from, None
        _theirs(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                path.open("a").close()  # opened to append, nothing written
            made = resume_from is not None or not path.exists()  # a resume's rewrite: made
            if made and not os.access(path.parent, os.W_OK):  # beside it, then moved onto it
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except OSError as exc:
            raise _unwritable(path, exc) from None

    def write(self, rows: list[dict[str, float]]) -> None:
        """Strict JSON lines: a NaN or infinite value is null."""
        if self.file is None:
            self.file = _open_metrics(self.path, self.resume_from)
        self.file.writelines(json.dumps(_finite(row), allow_nan=False) + "\n" for row in rows)
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _theirs(path: Path) -> None:
    """Refuse a --metrics-out that holds something other than a run's metrics (a file of
    the user's would be rewritten): every line a JSON object with a step, but a last one
    cut short (a killed run's)."""
    if not path.is_file():
        return
    try:
        with path.open("rb") as file:
            head = file.read(1 << 20)
        lines = head.decode().splitlines()
    except (OSError, UnicodeDecodeError):
        raise ConfigError(f"--metrics-out {path} is not a run's metrics (not text): name "
                          "another file, or remove it") from None  # fmt: skip
    whole = lines[:-1] if len(head) == 1 << 20 or not head.endswith(b"\n") else lines
    for number, line in enumerate(whole, 1):
        try:
            row = json.loads(line) if line.strip() else {"step": 0}
        except ValueError:
            row = None
        if not isinstance(row, dict) or "step" not in row:
            raise ConfigError(
                f"--metrics-out {path}: line {number} is not a row of a run's metrics, so the "
                f"file is not one shardplug wrote: name another file, or remove it"
            )


def _unwritable(path: Path, exc: OSError) -> ConfigError:
    return ConfigError(f"cannot write --metrics-out {path}: {exc.strerror}")


def _open_metrics(path: Path, resume_from: int | None) -> Any:
    """The metrics file, opened for this run. Resuming from step s keeps the rows of steps
    before s (dropping those a killed run logged past its checkpoint, which are run again,
    and any half-written line) and appends."""
    try:
        if resume_from is None or not path.exists():
            return path.open("w")
        kept = []
        for line in path.read_text().splitlines(keepends=True):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if line.endswith("\n") and isinstance(row, dict) and row.get("step", -1) < resume_from:
                kept.append(line)
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        partial.replace(path)
        return path.open("a")
    except OSError as exc:
        raise _unwritable(path, exc) from None
