"""What a training run shows while it runs, and the memory it checks before it starts: the
progress (a bar in a terminal, whole lines in a pipe) and the compiled step's peak against
what the host or the devices have."""

from __future__ import annotations

import sys
from typing import Any

from shardplug.errors import ConfigError


def host_available() -> int | None:
    """The bytes the kernel says it can still give processes (``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(trainer: Any) -> None:
    """Refuse, in one line, a step whose compiled peak does not fit: on simulated CPU
    devices (which share the host's memory) all this process's devices against what the
    host has available; on an accelerator each device's peak against its memory."""
    from shardplug.core.units import size
    from shardplug.planning.explain import backend_memory, peak_bytes

    analysis = trainer.compiled.memory_analysis() if trainer.compiled is not None else None
    on_cpu = trainer.mesh.local_devices[0].platform == "cpu"  # host memory is the devices'
    hlo = None if on_cpu or analysis is None else trainer.compiled.as_text()
    peak = peak_bytes(analysis, hlo) if analysis is not None else None
    if not peak:
        return
    devices = trainer.mesh.local_devices
    advice = ("use fewer devices (--devices), a smaller --batch-size or --sequence, or "
              "--remat; --skip-memory-check runs it anyway")  # fmt: skip
    if devices[0].platform == "cpu":
        need, have = peak * len(devices), host_available()
        if have is not None and need > have:
            raise ConfigError(
                f"the step needs {size(need)} of the host's {size(have)} available "
                f"({len(devices)} simulated CPU devices x {size(peak)}, sharing its memory): "
                + advice
            )
        return
    limit = backend_memory(devices[0])
    if limit and peak > limit:
        raise ConfigError(
            f"the step needs {size(peak)} a device, more than the {size(limit)} each "
            f"{devices[0].platform.upper()} lets this process allocate: " + advice
        )


def _status(row: dict[str, float]) -> str:
    """The progress bar's figures: loss, held-out loss, FLOP/s, MFU, memory, communication."""
    text = f"{row['loss']:.4f}"
    if "eval_loss" in row:
        text += f" (held out {row['eval_loss']:.4f})"
    if "model_tflops" in row:
        text += f" | {row['model_tflops'] * 1e3:.3g} GFLOP/s"
    if "mfu" in row:
        text += f" MFU {100 * row['mfu']:.1f}%"
    if "memory_peak" in row:
        text += f" | peak {row['memory_peak'] / 2**20:.1f} MiB"
    if "comm_share" in row:
        text += f" | comm {100 * row['comm_share']:.0f}%"
    return text


class _Ticking:
    """``batches``, calling ``tick(k)`` as batch k is read and ``tick(None)`` at the end;
    as long as ``batches`` is (an evaluation caps sources without a length)."""

    def __init__(self, batches: Any, tick: Any):
        self.batches, self.tick = batches, tick

    def __iter__(self) -> Any:
        for k, batch in enumerate(self.batches, 1):
            self.tick(k)
            yield batch
        self.tick(None)

    def __len__(self) -> int:
        return len(self.batches)  # TypeError for a source without a length, as len() says


class Progress:
    """A rich progress bar on stderr advanced by history rows, or nothing with --quiet."""

    def __init__(self, quiet: bool, total: int, done: int = 0):
        self.quiet, self.total, self.done = quiet, total, done

    def __enter__(self):
        if self.quiet:
            advance = lambda rows: None  # noqa: E731
            advance.evaluating = lambda batches: batches
            return advance
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        console = Console(stderr=True)
        if not console.is_terminal:  # a pipe or a log: whole lines, never cut to a width
            self.bar = None
            done = [self.done]

            def line(rows):
                done[0] += len(rows)
                print(f"training {done[0]}/{self.total} loss {_status(rows[-1])}",
                      file=sys.stderr, flush=True)  # fmt: skip

            line.evaluating = lambda batches: batches
            return line
        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            "loss {task.fields[loss]}",
            TimeRemainingColumn(),
            console=console,
        )
        self.bar.start()
        task = self.bar.add_task("training", total=self.total, completed=self.done, loss="-")

        def advance(rows):
            self.bar.update(task, advance=len(rows), loss=_status(rows[-1]))

        def tick(k: int | None) -> None:  # the bar says how far an evaluation has read
            self.bar.update(task, description="training" if k is None else f"evaluating {k}")

        advance.evaluating = lambda batches: _Ticking(batches, tick)
        return advance

    def __exit__(self, *exc):
        if not self.quiet and self.bar is not None:
            self.bar.stop()


def quiet_orbax() -> None:
    """Orbax reports routine events as absl warnings; the command line prints its own."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
