"""What ``explain`` shows: the report as tables and text pictures, and as a PNG."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from shardplug.core.units import size

if TYPE_CHECKING:
    from shardplug.planning.explain import ParamReport, Report


#: a layer's index in a path: a component that is a number (``blocks/0/wq``: a Python list
#: of blocks in NNX or Equinox) or that ends in one after ``_`` or ``.`` (``blocks_0/wq``,
#: as Linen names a list's members; ``blocks.0/wq``, as Griffin names its blocks)
_INDEX = re.compile(r"(?<![^/._])\d+(?![^/.])")


def groups(params: list[ParamReport]) -> list[dict[str, Any]]:
    """Parameters that share a layout and a reason, one row each: paths with their layer
    indices as ``*`` (``blocks/*/wq``, ``blocks_*/wq``), the shapes and specs, how many, and
    the bytes. A row of one parameter keeps its own path: numbered siblings that differ
    (Linen's ``Dense_0`` and ``Dense_1`` of other shapes) are not a group."""
    rows: dict[tuple, dict[str, Any]] = {}
    for p in params:
        pattern = _INDEX.sub("*", p.path)
        shape = "x".join(map(str, p.shape))
        key = (pattern, shape, p.spec, p.why, p.placed_by)
        row = rows.setdefault(
            key, {"path": p.path, "shape": shape, "spec": p.spec, "why": p.why,
                  "placed_by": p.placed_by, "count": 0, "bytes_per_device": 0},
        )  # fmt: skip
        row["count"] += 1
        row["bytes_per_device"] += p.bytes_per_device
        if row["count"] > 1:
            row["path"] = pattern
    return list(rows.values())


def render(report: Report, console: Any, every_row: bool = False) -> None:
    """Print the report as tables and pictures on a ``rich`` console; parameters that share
    a layout and a reason are one row unless ``every_row``."""
    from rich.table import Table

    mesh = ",".join(f"{k}={v}" for k, v in report.mesh.items())
    console.print(
        f"[bold]{report.strategy}[/bold] on {report.devices} {report.platform} devices "
        f"({mesh}); step compiled in {report.compile_seconds or 0:.1f} s"
    )
    if report.axis_types:
        types = report.axis_types
        console.print(f"mesh axes {types['types']}: {types['why']}")
    if len(report.order.get("mesh", ())) > 1:
        console.print(
            f"order: the mesh {', '.join(report.order['mesh'])} (outermost first); parameter "
            f"dimensions claimed {', '.join(report.order['claims'])}"
        )
    flops = report.precision.get("matmul_flops_by_dtype") or {}
    if flops:
        total = sum(flops.values())
        ranked = sorted(flops.items(), key=lambda kv: -kv[1])
        shares = ", ".join(f"{v / total:.1%} {k}" for k, v in ranked)
        console.print(f"computes in {report.precision['compute']}: matrix-product FLOPs {shares}")
    rows = groups(report.params)
    grouped = not every_row and len(rows) < len(report.params)
    title = f"parameters ({len(report.params)} in {len(rows)} groups; --all for each)"
    table = Table(title=title if grouped else "parameters", title_justify="left")
    columns = ("path", "shape", "spec", "placed by", "per device", "replicated because")
    for column in columns[:1] + (("count",) if grouped else ()) + columns[1:]:
        table.add_column(column, overflow="fold")
    for p in rows if grouped else report.params:
        if grouped:
            table.add_row(
                p["path"], str(p["count"]), p["shape"], p["spec"], p["placed_by"],
                size(p["bytes_per_device"]), p["why"] or "",
            )  # fmt: skip
        else:
            shape = "x".join(map(str, p.shape))
            table.add_row(p.path, shape, p.spec, p.placed_by, size(p.bytes_per_device), p.why or "")
    console.print(table)

    memory = Table(title="memory per device", title_justify="left")
    memory.add_column("what")
    memory.add_column("bytes", justify="right")
    d = report.per_device
    rows = [
        ("parameters", d["params_bytes"]),
        ("optimizer state", d["opt_state_bytes"]),
        ("gradients (reduced)", d["grads_bytes"]),
        ("model state", d["model_state_bytes"]),
        ("batch", d["batch_bytes"]),
        ("temporaries (activations, gradients in flight)", d["temp_bytes"]),
        ("peak: arguments + outputs - donated + temporaries", d["peak_bytes"]),
    ]
    if d.get("host_bytes"):  # offload: the state kept in host memory, not in the peak
        rows.append(("in host memory (offload), apart from the peak", d["host_bytes"]))
    for what, n in rows:
        memory.add_row(what, size(n))
    if d["device_memory_bytes"]:
        share = d["peak_bytes"] / d["device_memory_bytes"] if d["peak_bytes"] else 0
        memory.add_row("device memory", f"{size(d['device_memory_bytes'])} ({share:.1%} used)")
    console.print(memory)

    comm = Table(title="communication per step (per device)", title_justify="left")
    for column in ("", "collective", "dtype", "count", "result bytes", "sent (ring)"):
        comm.add_column(column, justify="right" if "bytes" in column else "left")
    for c in report.collectives:
        comm.add_row(
            "compiled", c["kind"], c["dtype"], str(c["count"]), size(c["bytes"]),
            size(c["wire_bytes"]),
        )  # fmt: skip
    for t in report.textbook:
        comm.add_row("textbook", t["kind"], "", "", size(t["bytes"]), size(t["wire_bytes"]))
    if not report.collectives:
        comm.add_row("compiled", "none", "", "", "", "")
    console.print(comm)
    if report.textbook:
        ratio = report.wire_bytes() / max(report.textbook_wire_bytes(), 1)
        console.print(
            f"sent per step: {size(report.wire_bytes())} compiled, "
            f"{size(report.textbook_wire_bytes())} textbook ({ratio:.3f}x)"
        )
    for note in report.notes:
        console.print(f"note: {note}")
    if report.timing:
        from shardplug.planning.explain_time import lines

        for line in lines(report.timing):
            console.print(line, highlight=False)
    if report.pipeline:
        _pipeline(console, report.pipeline)
    for picture in report.pictures:
        console.print(_grid(picture, report.devices))


def _pipeline(console: Any, pl: dict[str, Any]) -> None:
    """A pipeline's schedule: its bubble against the formula, the microbatches each stage
    holds, its sends, which layers each stage holds, and (when short) its chart."""
    console.print(
        f"pipeline: {pl['schedule']}, {pl['stages']} stages, {pl['microbatches']} "
        f"microbatches, repeats {pl['repeats']}, {pl['ticks']} ticks: bubble "
        f"{pl['bubble']:.1%} (formula {pl['formula']:.1%}); the layer stack "
        f"{size(pl['stack_bytes'])}, {size(pl['stack_bytes_per_device'])} per device"
    )
    peaks = ", ".join(f"{p:g}" for p in pl["peak_microbatches"])
    console.print(f"microbatches' activations held at most, by stage: {peaks}")
    cp = pl["collective_permute"]
    if "textbook_bytes_per_step" in cp:
        console.print(
            f"collective-permutes per step: {size(cp['compiled_bytes_per_step'])} compiled, "
            f"{size(cp['textbook_bytes_per_step'])} by the schedule"
        )
    else:
        ticks = cp["sending_ticks"]
        console.print(
            f"sends: forward on {ticks['forward']} ticks, back on {ticks['backward']} (one "
            f"microbatch's stage input or its gradient each)"
        )
    for stage, held in enumerate(pl["stage_layers"]):
        console.print(f"  stage {stage}: layers {', '.join(map(str, held))}")
    if pl.get("chart") and pl["ticks"] <= 48:
        console.print("schedule (F forward, B input gradient, W weight gradient, . idle):")
        for stage, line in enumerate(pl["chart"].splitlines()):
            console.print(f"  stage {stage}: {line}", markup=False, highlight=False,
                          soft_wrap=True)  # fmt: skip


def _grid(picture: dict[str, Any], devices: int) -> Any:
    """A table whose cells are the blocks of an array and the devices that hold them."""
    from rich.table import Table

    dims = picture["dims"]
    shape = picture["shape"]
    label = [("-" if d is None else f"dim {d} ({shape[d]})") for d in dims]
    table = Table(show_lines=True)
    rows = sorted({tuple(b[0]) for b in picture["blocks"]})
    cols = sorted({tuple(b[1]) for b in picture["blocks"]})
    table.add_column("")
    for c in cols:
        table.add_column(f"{c[0]}:{c[1]}")
    cells = {(tuple(r), tuple(c)): ids for r, c, ids in picture["blocks"]}
    for r in rows:
        table.add_row(f"{r[0]}:{r[1]}", *(_devices(cells.get((r, c), []), devices) for c in cols))
    from rich.console import Group

    title = (
        f"[italic]{picture['name']}[/italic] {'x'.join(map(str, shape))} {picture['spec']}: "
        f"rows {label[0]}, columns {label[1]}"
    )
    return Group(title, table)


def _devices(ids: list[int], total: int) -> str:
    if len(ids) == total and total > 1:
        return f"all {total} devices"
    return (
        "device " + ",".join(map(str, ids))
        if len(ids) == 1
        else "devices " + ",".join(map(str, ids))
    )


def plot(report: Report, path: str) -> None:
    """Draw the pictures of :func:`render` into a PNG: one panel per array, blocks to scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    pictures = report.pictures
    fig, axes = plt.subplots(1, len(pictures), figsize=(6 * len(pictures), 5), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, picture in zip(axes[0], pictures, strict=True):
        shape, dims = picture["shape"], picture["dims"]
        height = shape[dims[0]] if dims[0] is not None else 1
        width = shape[dims[1]] if dims[1] is not None else 1
        for k, (rows, cols, ids) in enumerate(picture["blocks"]):
            ax.add_patch(
                Rectangle(
                    (cols[0] / width, 1 - rows[1] / height),
                    (cols[1] - cols[0]) / width,
                    (rows[1] - rows[0]) / height,
                    facecolor=colours(k % 10),
                    edgecolor="black",
                    alpha=0.6,
                )
            )
            ax.text(
                (cols[0] + cols[1]) / 2 / width,
                1 - (rows[0] + rows[1]) / 2 / height,
                _devices(ids, report.devices).replace("devices ", "dev "),
                ha="center",
                va="center",
                fontsize=9,
                wrap=True,
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xticks([])
        ax.set_yticks([])
        names = [("-" if d is None else f"dim {d} ({shape[d]})") for d in dims]
        ax.set_title(
            f"{picture['name']} {'x'.join(map(str, shape))}\n{picture['spec']}", fontsize=10
        )
        ax.set_ylabel(names[0])
        ax.set_xlabel(names[1])
    mesh = ",".join(f"{k}={v}" for k, v in report.mesh.items())
    fig.suptitle(f"{report.strategy} on {report.devices} devices ({mesh})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_bench(report: dict[str, Any], console: Any) -> None:
    """The bench as a table on a ``rich`` console."""
    from rich.table import Table

    table = Table(
        title=f"{report['model']} ({report['adapter']}), batch {report['batch_size']}, "
        f"{report['devices']} {report['platform']} devices: median of {report['rounds']} "
        f"interleaved rounds of {report['steps_per_round']} steps",
        title_justify="left",
    )
    for column in ("contender", "compile s", "step ms", "samples/s", "tokens/s", "peak/device",
                   "vs hand-written", "speedup vs 1 device"):  # fmt: skip
        table.add_column(column, justify="left" if column == "contender" else "right")
    for r in report["results"]:
        strategy = r["strategy"]
        mine = r["kind"] == "shardplug"
        table.add_row(
            r["name"] if r["kind"] != "shardplug" else f"[bold]{r['name']}[/bold]",
            f"{r['compile_seconds']:.2f}",
            f"{1000 * r['median_step_seconds']:.2f}",
            f"{r['samples_per_second']:.0f}",
            "" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:.0f}",
            size(r["peak_bytes"]) if r["peak_bytes"] is not None else "",
            f"{report['ratios'][strategy]:.3f}x" if mine else "",
            f"{report['speedup'][strategy]:.2f}x" if mine else "",
        )
    console.print(table)
    if report["nnx_jit_ratio"] is not None:
        console.print(
            f"shardplug dp / the nnx.jit loop of Flax's documentation: "
            f"{report['nnx_jit_ratio']:.3f}x"
        )
    worst = max(report["max_loss_diff"].values())
    console.print(f"losses equal the hand-written runs' within {worst:.1e} (relative)")


def plot_bench(report: dict[str, Any], path: str) -> None:
    """Bars of the median step time of every contender, with the figures on them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [r["name"] for r in results]
    times = [1000 * r["median_step_seconds"] for r in results]
    colours = {"shardplug": "tab:blue", "hand-written": "tab:gray", "nnx.jit": "tab:orange",
               "one device": "tab:green"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4.5))
    bars = ax.bar(names, times, color=[colours[r["kind"]] for r in results])
    for bar, r, t in zip(bars, results, times, strict=True):
        text = f"{t:.2f} ms"
        if r["kind"] == "shardplug":
            text += f"\n{report['ratios'][r['strategy']]:.3f}x"
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("median step (ms)")
    ax.set_title(
        f"{report['model']} ({report['adapter']}) on {report['devices']} {report['platform']} "
        f"devices; x = shardplug / hand-written",
        fontsize=10,
    )
    ax.tick_params(axis="x", rotation=30)
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_bench_plan(result: dict[str, Any], console: Any) -> None:
    """``bench --plan``'s predicted steps, fastest first, beside their hand-written twins'."""
    from rich.table import Table

    title = (f"{result['model']}: steps predicted on {result['devices']} x {result['device']} "
             "(compiled here, nothing run; float32, as the twin computes)")  # fmt: skip
    table = Table(title=title, title_justify="left")
    for column in ("strategy", "predicted step", "hand-written", "ratio", "tokens/s", "MFU",
                   "peak/device"):  # fmt: skip
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for r in result["plans"]:
        table.add_row(
            r["strategy"], f"{r['predicted_seconds'] * 1e3:,.1f} ms",
            f"{r['hand_written_seconds'] * 1e3:,.1f} ms", f"{r['ratio']:.3f}",
            f"{r['tokens_per_second']:,.0f}" if r["tokens_per_second"] else "",
            f"{r['mfu']:.1%}" if r["mfu"] else "", size(r["peak_bytes"]),
        )  # fmt: skip
    console.print(table)
    runner = result.get("runner_up")
    if runner:
        console.print(f"fastest: [bold]{result['plans'][0]['strategy']}[/bold]; the runner-up, "
                      f"{runner['strategy']}, takes {runner['ratio']:.2f}x as long")  # fmt: skip


def render_recommend(result: dict[str, Any], console: Any, title: str) -> None:
    """``recommend``'s ranking as a table on a ``rich`` console, and its choice."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    timed = any(r.get("predicted_seconds") for r in result["strategies"])
    columns = ("strategy", "fits", "peak/device", "params+opt/device", "sent/step")
    for column in columns + (("predicted step", "MFU") if timed else ()):
        table.add_column(column, justify="left" if column in ("strategy", "fits") else "right")
    refused: dict[str, list[str]] = {}  # one row per reason (ep's, for a model without experts)
    for r in result["strategies"]:
        if "error" in r:
            refused.setdefault(r["error"], []).append(r["strategy"])
            continue
        when = r.get("predicted_seconds")
        table.add_row(
            r["strategy"], "yes" if r["fits"] else "no", size(r["peak_bytes"]),
            size(r["params_bytes"] + r["opt_state_bytes"]), size(r["sent_bytes"]),
            *((f"{when * 1e3:,.1f} ms" if when else "",
               f"{r['mfu']:.1%}" if r.get("mfu") else "") if timed else ()),
        )  # fmt: skip
    for error, names in refused.items():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        table.add_row(names[0] + more, "no", "", "", error, *(("", "") if timed else ()))
    console.print(table)
    choice, reason = result["recommended"], result["reason"]
    flags = "".join(
        f" -o {k if '.' in k else 'pp.' + k}={str(v).lower() if isinstance(v, bool) else v}"
        for k, v in (result.get("options") or {}).items()
    )
    console.print(f"recommended: [bold]{choice}{flags}[/bold]: {reason}" if choice
                  else f"recommended: none: {reason}")  # fmt: skip


def render_longest(result: dict[str, Any], console: Any, title: str) -> None:
    """``recommend --longest-sequence``'s table: each strategy's longest sequence that fits."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("strategy", "mesh", "batch", "longest sequence", "peak there", "over at"):
        table.add_column(column, justify="left" if column in ("strategy", "mesh") else "right")
    for r in result["strategies"]:
        if "error" in r:
            table.add_row(r["strategy"], "", "", "", "", r["error"])
            continue
        over = dict(r["tried"]).get(r["first_over"]) if r["first_over"] else None
        table.add_row(
            r["strategy"], ",".join(f"{k}={v}" for k, v in r["mesh"].items()), str(r["rows"]),
            ("not searched: the time ran out first" if r.get("timed_out") and not r["longest"]
             else f"at least {r['longest']:,} (the time ran out)" if r.get("timed_out") else
             f"{r['longest']:,} (the model's most positions)" if r.get("capped")
             and result.get("limited_by") == "the model's positions" else
             f"at least {r['longest']:,} (the most tried)" if r.get("capped") else
             f"{r['longest']:,}") if r["longest"] else "none",
            size(r["peak_bytes"]) if r["peak_bytes"] else "",
            f"{r['first_over']:,} ({size(over)})" if over else "",
        )  # fmt: skip
    console.print(table)
    bound = (f"up to the model's {result['limit']:,} positions"
             if result.get("limited_by") == "the model's positions" else
             f"up to {result.get('limit') or 1 << 20:,} tokens")  # fmt: skip
    seconds = f" and {result['seconds']:.0f} s" if result.get("seconds") else ""
    console.print(
        f"the step compiled at each length tried ({bound}{seconds}), nothing allocated; peaks "
        f"against {size(result['device_memory'])} per device"
    )


__all__ = [
    "groups", "plot", "plot_bench", "render", "render_bench", "render_bench_plan",
    "render_longest", "render_recommend", "size",
]  # fmt: skip
