"""Pipeline schedules that write the backward pass in (1F1B, interleaved 1F1B, ZB-H1, ZB-V):
their tables against the formulas, chunks placed in a V, the backward pass cut in two,
trajectories equal to one device's in every composition, activation memory flat in the
microbatches, and bad input in one line."""

import dataclasses
import json
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_registry import fresh_registry, install  # noqa: F401 (a fixture)

import shardplug
from shardplug import stack
from shardplug.cli import main
from shardplug.errors import ConfigError, StrategyOptionError
from shardplug.planning.explain import explain
from shardplug.plugin import Schedule, looped, tabulate, v_shape
from shardplug.strategies.pp import backward
from shardplug.strategies.pp.schedules import (
    SCHEDULES,
    find_schedule,
    installed,
    one_f_one_b,
    zero_bubble,
    zero_bubble_v,
)
from shardplug.testing.conformance import _losses, one_device_losses

STEPS = 2
NAMES = tuple(SCHEDULES)


def chunks(name):
    return (SCHEDULES[name].repeats or 2) if SCHEDULES[name].chunked else 1


# -- the tables ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_each_schedules_bubble_is_its_formula(name, stages, microbatches):
    v = chunks(name)
    table = SCHEDULES[name].table(stages, microbatches, v)
    assert table.bubble == pytest.approx(SCHEDULES[name].formula(stages, microbatches, v))
    assert len(set(table.idle.tolist())) == 1  # every stage idles alike


def test_zero_bubble_vs_formula_holds_for_every_microbatch_count():
    """(S-1)/(6M+S-1) once the V is full; with fewer microbatches its idle ticks, exactly."""
    zbv = SCHEDULES["zbv"]
    for stages in (2, 3, 4, 8):
        for m in range(1, 2 * stages + 2):
            assert zbv.table(stages, m, 2).bubble == pytest.approx(zbv.formula(stages, m, 2))
        assert zbv.formula(stages, 2 * stages, 2) == (stages - 1) / (12 * stages + stages - 1)


@pytest.mark.parametrize("name", NAMES)
def test_a_stage_holds_at_most_about_s_microbatches_whatever_m(name):
    v = chunks(name)
    peaks = [SCHEDULES[name].table(4, m, v).peak for m in (8, 16, 32)]
    assert peaks[0] == peaks[1] == peaks[2]
    assert max(peaks[0]) == {"1f1b": 4, "zb": 4, "interleaved-1f1b": 5.5, "zbv": 4}[name]


def replay(table):
    """Run a table as the tick loop does, independently of how it was made: every pass once,
    on the stage its chunk is placed on, each after what it needs, every message from the
    stage the table says, every buffer read holding what the pass needs."""
    s_, c_, m_ = table.stages, table.stages * table.chunks, table.microbatches
    where = table.placement
    done = {}
    slots = [{k: {} for k in ("residual", "inbox", "grad", "stash")} for _ in range(s_)]
    sent = [None] * s_
    for t in range(table.ticks):
        for d in range(s_):  # arrivals of what was sent at t-1
            sources = {"recv_forward": (d - 1) % s_, "recv_backward": (d + 1) % s_,
                       "recv_forward_after": (d + 1) % s_, "recv_backward_before": (d - 1) % s_,
                       "recv_forward_self": d, "recv_backward_self": d}  # fmt: skip
            for field, source in sources.items():
                slot = getattr(table, field)[t, d]
                if slot < 0:
                    continue
                kind, c, m = sent[source]
                to = c + 1 if kind == "F" else c - 1
                assert kind == ("F" if "forward" in field else "B") and where[to] == d
                slots[d]["inbox" if kind == "F" else "grad"][slot] = ("xg"[kind == "B"], to, m)
            if table.recv_loss[t, d] >= 0:
                own = sent[d]
                assert own[0] == "F" and own[1] == c_ - 1
                slots[d]["grad"][table.recv_loss[t, d]] = ("g", own[1], own[2])
        now = [None] * s_
        for d in range(s_):
            kind = " FBW"[table.kind[t, d]]
            if kind == " ":
                continue
            c, m = int(table.model_chunk[t, d]), int(table.micro[t, d])
            assert where[c] == d and (kind, c, m) not in done
            if kind == "F":
                assert c == 0 or done[("F", c - 1, m)] < t
                if c > 0:
                    assert slots[d]["inbox"][table.inbox[t, d]] == ("x", c, m)
                slots[d]["residual"][table.residual[t, d]] = ("r", c, m)
            elif kind == "B":
                assert done[("F", c, m)] < t
                assert slots[d]["residual"][table.residual[t, d]] == ("r", c, m)
                assert slots[d]["grad"][table.grad[t, d]] == ("g", c, m)
                slots[d]["stash"][table.stash[t, d]] = ("s", c, m)
            else:
                assert slots[d]["residual"][table.residual[t, d]] == ("r", c, m)
                assert slots[d]["stash"][table.stash[t, d]] == ("s", c, m)
            done[(kind, c, m)] = t
            now[d] = (kind, c, m)
        sent = now
    assert len(done) == 3 * c_ * m_


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (4, 4), (4, 12), (3, 9)])
def test_every_pass_runs_once_after_its_inputs_from_the_right_slots(name, stages, microbatches):
    replay(SCHEDULES[name].table(stages, microbatches, chunks(name)))


def test_lists_that_are_not_a_schedule_are_refused_in_one_line():
    lists = one_f_one_b(2, 2)
    with pytest.raises(ConfigError, match="exactly once"):
        tabulate("short", [lists[0][:-1], lists[1]])
    with pytest.raises(ConfigError, match="runs chunk 1 on stage 0, and its placement puts it "
                                          "on stage 1"):  # fmt: skip
        tabulate("swapped", [lists[1], lists[0]])
    backwards_first = [[p for p in seq if p[0] != "F"] + [p for p in seq if p[0] == "F"]
                       for seq in lists]  # fmt: skip
    with pytest.raises(ConfigError, match="never finishes"):
        tabulate("stuck", backwards_first)


def test_placements_that_a_message_cannot_follow_are_refused_in_one_line():
    lists = zero_bubble_v(4, 8)
    with pytest.raises(ConfigError, match=r"places its 8 chunks as \[0, 1, 2, 3, 3, 2, 1\]: "
                                          "the placement must put one of each 4 consecutive "
                                          "chunks on each stage"):  # fmt: skip
        tabulate("short", lists, 2, placement=lambda s, v: v_shape(s, v)[:-1])
    with pytest.raises(ConfigError, match="places chunk 0 on stage 0 and chunk 1 on stage 2: "
                                          "consecutive chunks must live on one stage or on "
                                          "neighbours of the ring"):  # fmt: skip
        tabulate("jumps", lists, 2, placement=lambda s, v: [0, 2, 1, 3, 3, 1, 2, 0])
    with pytest.raises(ConfigError, match="runs chunk 7 on stage 0, and its placement puts it "
                                          "on stage 3"):  # fmt: skip
        tabulate("zbv-looped", lists, 2, placement=looped)


@pytest.mark.parametrize("stages", [2, 4])
def test_zero_bubble_v_places_its_chunks_in_a_v(stages):
    """ZB-V's chunks run down the stages and back up: the first and the last chunk on stage 0,
    where the loss's gradient comes back; the turn from chunk S-1 to chunk S stays on stage
    S-1; every other message goes to a neighbour, down the ring going down and up it coming
    back (each way's fields, for S > 2, where the two neighbours differ)."""
    table = SCHEDULES["zbv"].table(stages, 2 * stages, 2)
    assert table.stage_chunks == [[s, 2 * stages - 1 - s] for s in range(stages)]
    assert v_shape(stages, 2) == list(table.placement) and not table.one_way
    used = {f: set(np.nonzero((getattr(table, f) >= 0).any(0))[0].tolist())
            for f in ("recv_loss", "recv_forward_self", "recv_backward_self",
                      "recv_forward_after", "recv_backward_before")}  # fmt: skip
    assert used["recv_loss"] == {0}
    assert used["recv_forward_self"] == used["recv_backward_self"] == {stages - 1}
    back_up = set(range(stages - 1)) if stages > 2 else set()
    assert used["recv_forward_after"] == back_up
    assert used["recv_backward_before"] == (set(range(1, stages)) if stages > 2 else set())


def test_a_v_schedule_takes_its_own_chunk_count():
    assert shardplug.get_strategy("pp", schedule="zbv").parts["pp"].repeats == 2
    assert shardplug.get_strategy("pp", schedule="zbv", repeats=2).parts["pp"].repeats == 2
    with pytest.raises(
        StrategyOptionError,
        match=r"pp's zbv schedule runs 2 chunks of layers per "
        r"stage, not repeats=3: leave pp\.repeats out",
    ):
        shardplug.get_strategy("pp", schedule="zbv", repeats=3)


def test_zero_bubble_puts_off_a_stages_weight_gradients_by_its_index():
    lists = zero_bubble(4, 8)
    for stage, seq in enumerate(lists):
        order = [p for p in seq if p[0] in "BW"]
        first_w = next(i for i, p in enumerate(order) if p[0] == "W")
        assert sum(p[0] == "B" for p in order[:first_w]) == stage + 1


# -- the backward pass, cut in two -----------------------------------------------------------


def test_the_input_and_weight_halves_are_the_pullback_each_operation_once():
    @jax.jit
    def norm(x):
        return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)

    def block(w, h):
        q = (h @ w["q"]).reshape(*h.shape[:2], 2, 4)
        a = jax.nn.dot_product_attention(q, q, q, is_causal=True).reshape(h.shape)
        h = h + norm(a) @ w["o"]
        return h + jax.checkpoint(lambda h: jnp.tanh(h @ w["up"]) @ w["down"])(h)

    keys = jax.random.split(jax.random.key(0), 6)
    w = {k: jax.random.normal(keys[i], s) * 0.3 for i, (k, s) in
         enumerate({"q": (8, 8), "o": (8, 8), "up": (8, 16), "down": (16, 8)}.items())}  # fmt: skip
    h = jax.random.normal(keys[4], (2, 5, 8))
    y, pull = jax.vjp(block, w, h)
    kept, tree = jax.tree.flatten(pull)
    gy = jax.random.normal(keys[5], y.shape)
    cut, _ = backward.cut(lambda k, g: jax.tree.unflatten(tree, k)(g[0]), kept, (gy,))
    gx, stash = backward.input_grads(cut, kept, [gy])
    gw = backward.weight_grads(cut, kept, stash)
    want_w, want_x = pull(gy)
    # the same operations, run apart: equal but for the last bit of a sum XLA may fuse
    # otherwise (seen on some CPUs)
    np.testing.assert_allclose(gx[0], want_x, rtol=1e-5, atol=1e-6)
    for got, want in zip(gw, jax.tree.leaves(want_w), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not set(cut.b) & set(cut.w) and cut.w and cut.shared == 0
    products = [cut.flat.eqns[i].eqn.primitive.name == "dot_general" for i in cut.w]
    assert sum(products) >= 4  # each weight's product is W's, not B's


# -- trajectories ----------------------------------------------------------------------------

COMPOSITIONS = {
    "pp": ("stage=4", {}, {}),
    "pp+fsdp": ("stage=2,fsdp=4", {"min_size": 0}, {}),
    "pp+fsdp+tp": ("stage=2,fsdp=2,model=2", {"min_size": 0}, {}),
    "pp+cp": ("stage=2,context=4", {}, {}),
    "pp+ep": ("stage=2,expert=4", {"microbatches": 4}, {"experts": 4, "top_k": 2}),
}


# NNX runs every schedule in every composition (the README's command); Linen and Equinox take
# turns (CI's slow run), so that each of them runs every schedule and every composition: every
# pair of (composition, schedule, adapter) is run, in 30 rows rather than 45 (all 45 passed
# when the schedules landed). The conformance suite runs every schedule in every adapter too.
MATRIX = [(c, n, "nnx") for c in COMPOSITIONS for n in NAMES] + [
    (c, n, ("linen", "equinox")[(i + j) % 2])
    for i, c in enumerate(COMPOSITIONS) for j, n in enumerate(NAMES)
]  # fmt: skip


@pytest.mark.parametrize(("composition", "name", "adapter"), MATRIX)
def test_every_schedule_trains_like_one_device(composition, name, adapter):
    mesh, options, model_options = COMPOSITIONS[composition]
    v = chunks(name)
    model_options = {**model_options, "layers": 4 * v}
    options = {**options, "schedule": name, "repeats": v}
    devices = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    got = _losses(composition, options, adapter, "transformer", STEPS, 0, devices, mesh,
                  model_options)  # fmt: skip
    want = one_device_losses(adapter, "transformer", STEPS, 0, tuple(sorted(model_options.items())))
    np.testing.assert_allclose(got, want, rtol=1e-4)


# -- memory and the bubble as explain reports them -------------------------------------------


def explained(name, microbatches, rows=4, **options):
    model = shardplug.get_model("transformer")
    trainer = shardplug.Trainer(
        model.adapter("nnx", layers=8), loss_fn=model.loss_fn, optimizer=optax.adam(1e-3),
        strategy=shardplug.get_strategy("pp", schedule=name, microbatches=microbatches,
                                        **options),
        devices=4, mesh="stage=4", allocate=False, precision="float32",
    )  # fmt: skip
    return explain(trainer, next(model.batches(rows * microbatches, 0)))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_activation_memory_is_flat_in_the_microbatches_where_the_backward_is_written_in(name):
    """Microbatches of 4 rows, M = 8, 16, 32 at S = 4: the compiled step's temporaries
    per device (nothing allocated) stay within 10% under 1F1B and grow under GPipe."""
    temp = [explained(name, m).per_device["temp_bytes"] for m in (8, 16, 32)]
    if name == "gpipe":
        assert temp[1] > 1.25 * temp[0] and temp[2] > 1.6 * temp[1]
    else:
        assert max(temp) <= 1.1 * min(temp)


def test_explain_reports_the_schedules_bubble_peak_and_sends():
    report = explained("zb", 8)
    pl = report.pipeline
    assert pl["schedule"] == "zb" and pl["ticks"] == 3 * 8 + 3 == pl["compiled_ticks"]
    assert pl["bubble"] == pytest.approx(3 / 27) == pytest.approx(pl["formula"])
    assert pl["peak_microbatches"] == [4, 4, 4, 4]
    table = SCHEDULES["zb"].table(4, 8)
    stage = np.arange(4)[None, :]
    forward = int(((table.kind == 1) & (stage < 3)).any(axis=1).sum())  # F before the last
    backward = int(((table.kind == 2) & (stage > 0)).any(axis=1).sum())  # B after the first
    sends = pl["collective_permute"]["sending_ticks"]
    assert sends == {"forward": forward, "backward": backward} and 0 < forward < pl["ticks"]


def test_explain_reports_zero_bubble_v_in_its_v_and_its_one_more_send():
    """ZB-V at S = 4, M = 8 on 8 layers: the table's ticks compiled, its bubble its formula,
    1F1B's peak, each stage's layers in a V; and against interleaved 1F1B (the same two
    chunks a stage, looped), the V's turn costs one chunk's share of the stack more each
    way, params to their stages and gradients back: the stack's bytes per device in all."""
    pl = explained("zbv", 8).pipeline
    assert pl["ticks"] == 6 * 8 + 3 == pl["compiled_ticks"]
    assert pl["bubble"] == pytest.approx(3 / 51) == pytest.approx(pl["formula"])
    assert pl["peak_microbatches"] == [4, 4, 4, 4]
    assert pl["stage_layers"] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    sending = SCHEDULES["zbv"].table(4, 8, 2).sending
    assert pl["collective_permute"]["sending_ticks"] == {
        "forward": int(sending["after"].sum()),
        "backward": int(sending["before"].sum()),
    }
    looped = explained("interleaved-1f1b", 8, repeats=2).pipeline
    sends = pl["collective_permute"]["compiled_bytes_per_step"]
    assert (
        sends - looped["collective_permute"]["compiled_bytes_per_step"]
        == pl["stack_bytes_per_device"]
    )


# -- bad input, and schedules of one's own ----------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "2f2b"}, "pp option schedule must be one of gpipe, 1f1b"),
        ({"schedule": "1f1b", "repeats": 2}, "repeats=2 interleaves chunks of layers"),
        ({"schedule": "interleaved-1f1b"}, "give -o pp.repeats=V with V >= 2"),
    ],
)
def test_bad_schedule_options_are_one_line(options, message):
    with pytest.raises(StrategyOptionError, match=message):
        shardplug.get_strategy("pp", **options)


def test_what_a_written_schedule_cannot_run_is_one_line(capsys):
    model = shardplug.get_model("transformer")
    biased = model.task("nnx", experts=4, top_k=2, bias_rate=0.05, layers=4)
    trainer = biased.trainer(strategy=shardplug.get_strategy("pp", schedule="zb"),
                             mesh="stage=4", devices=4)  # fmt: skip
    with pytest.raises(ConfigError, match="updates its state from the batch"):
        trainer.compile(next(model.batches(model.batch_size, 0)))
    argv = ["train", "--steps", "1", "--quiet", "--strategy", "pp", "--mesh", "stage=4",
            "--devices", "4", "--layers", "4", "-o", "pp.schedule=1f1b",
            "--grad-accum", "2"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "accumulates its microbatches itself" in err and err.count("\n") == 1


class Rolled(nnx.Module):
    """Blocks that shift their rows (split over fsdp): the compiler sends between devices."""

    def __init__(self, rngs):
        self.blocks = stack.nnx_layers(lambda r: RollBlock(r), 4, rngs)

    def __call__(self, x):
        return stack.apply(self.blocks, x)


class RollBlock(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.w(jnp.roll(x, 1, axis=0)))


def test_a_send_inside_a_stages_own_pass_is_refused_not_waited_for():
    data = [{"x": np.ones((16, 8, 16), np.float32), "y": np.zeros((16, 8, 16), np.float32)}]
    for schedule in ("1f1b", "gpipe", "auto"):
        trainer = shardplug.Trainer(
            shardplug.from_nnx(Rolled), loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
            optimizer=optax.sgd(0.1), strategy=shardplug.get_strategy("pp+fsdp",
                                                                     schedule=schedule),
            mesh="stage=2,fsdp=4", devices=8,
        )  # fmt: skip
        if schedule == "gpipe":  # one program on every stage: it runs
            assert np.isfinite(trainer.fit(data, 1)[0]["loss"])
            continue
        if schedule == "auto":  # the default: compiled again as GPipe, said once (naming
            # the roll's line where the program's metadata keeps it: JAX 0.10, not 0.12)
            with pytest.warns(shardplug.ShardplugWarning, match="runs gpipe.* a send between"):
                assert np.isfinite(trainer.fit(data, 1)[0]["loss"])
            continue
        with pytest.raises(ConfigError, match=r"made the model's \w+ at .+:\d+ a send between"):
            trainer.fit(data, 1)


def test_the_default_runs_zero_bubble_where_it_can_and_gpipe_where_not():
    assert explained("auto", 8).pipeline["schedule"] == "zb"
    pl = explained("auto", 8, repeats=2).pipeline
    assert pl["schedule"] == "interleaved-1f1b" and pl["bubble"] == pytest.approx(3 / 19)
    model = shardplug.get_model("transformer")
    biased = model.task("nnx", experts=4, top_k=2, bias_rate=0.05, layers=4)
    trainer = biased.trainer(strategy="pp", mesh="stage=4", devices=4)  # the default
    with pytest.warns(shardplug.ShardplugWarning, match="runs gpipe.*updates its state"):
        rows = trainer.fit(model.batches(model.batch_size, 0), 1)
    assert np.isfinite(rows[0]["loss"])
    report = explain(trainer, next(model.batches(model.batch_size, 0)))
    assert report.pipeline["schedule"] == "gpipe"


LATE_W = textwrap.dedent(
    """
    from shardplug.plugin import Schedule
    from shardplug.strategies.pp.schedules import one_f_one_b

    def late(stages, microbatches, chunks):
        # 1F1B's order, every weight gradient at the end: a stage holds every microbatch
        lists = one_f_one_b(stages, microbatches)
        return [[p for p in seq if p[0] != "W"] + [p for p in seq if p[0] == "W"]
                for seq in lists]

    LATE = Schedule("late-w", late, lambda s, m, v: (s - 1) / (3 * m + s - 1))
    """
)


def test_a_schedule_of_ones_own_trains_like_one_device(tmp_path, monkeypatch, fresh_registry):  # noqa: F811
    install(tmp_path, monkeypatch, "latew", "0.1", {"late-w": "latew:LATE"}, {"latew": LATE_W},
            group="shardplug.schedules")  # fmt: skip
    installed.cache_clear()
    try:
        late = find_schedule("late-w")
        assert isinstance(late, Schedule) and late.table(4, 8).peak[0] == 8
        got = _losses("pp", {"schedule": "late-w"}, "nnx", "transformer", STEPS, 0, 4,
                      "stage=4", {"layers": 4})  # fmt: skip
        want = one_device_losses("nnx", "transformer", STEPS, 0, (("layers", 4),))
        np.testing.assert_allclose(got, want, rtol=1e-4)
    finally:
        installed.cache_clear()


def test_strategies_lists_every_schedule_with_its_source(
    tmp_path,
    monkeypatch,
    capsys,
    fresh_registry,  # noqa: F811 (the fixture)
):
    install(tmp_path, monkeypatch, "latew", "0.1", {"late-w": "latew:LATE"}, {"latew": LATE_W},
            group="shardplug.schedules")  # fmt: skip
    installed.cache_clear()
    try:
        assert main(["strategies", "--all", "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert (rows["late-w"]["kind"], rows["late-w"]["source"]) == ("schedule", "latew 0.1")
        assert (rows["late-w"]["package"], rows["late-w"]["version"]) == ("latew", "0.1")
        assert rows["zb"]["source"] == rows["gpipe"]["source"] == "built-in"
        assert main(["strategies"]) == 0
        assert "late-w (latew 0.1)" in capsys.readouterr().out
        with pytest.raises(StrategyOptionError, match="'gpipe' is pp's own schedule"):
            find_schedule("gpipe")  # not 'must be one of gpipe, ..., got gpipe'
    finally:
        installed.cache_clear()


def test_explain_prints_the_schedule(capsys):
    argv = ["explain", "--strategy", "pp", "--mesh", "stage=4", "--devices", "4", "--layers",
            "8", "-o", "pp.schedule=1f1b", "-o", "microbatches=4"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    pl = json.loads(capsys.readouterr().out)["pipeline"]
    assert pl["schedule"] == "1f1b" and pl["bubble"] == pytest.approx(3 / 7)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bubble 42.9% (formula 42.9%)" in out
    assert "stage 3: .  .  .  F0 B0 W0 F1 B1 W1" in out


def test_the_pytest_plugin_and_recommend_read_the_schedules_from_the_registry(monkeypatch):
    """A schedule added to pp's registry is in the pytest plugin's matrix, and recommend
    plans under it unless it needs chunks of its own (repeats)."""
    from shardplug.planning.recommend import planned_schedules
    from shardplug.strategies.pp import schedules
    from shardplug.testing.pytest_plugin import installed_schedules

    assert installed_schedules()[:5] == ["gpipe", *SCHEDULES]
    assert planned_schedules() == ["gpipe", "1f1b", "zb"]
    added = dataclasses.replace(SCHEDULES["zb"], name="zb-copy")
    monkeypatch.setitem(schedules.SCHEDULES, "zb-copy", added)
    schedules.installed.cache_clear()
    try:
        assert "zb-copy" in installed_schedules() and "zb-copy" in planned_schedules()
    finally:
        monkeypatch.undo()
        schedules.installed.cache_clear()


def test_recommend_picks_a_schedule_as_well_as_a_composition():
    from shardplug.planning.recommend import recommend

    model = shardplug.get_model("transformer")
    task = model.task("nnx", layers=8)

    made = {}

    def compile_trainer(name, options=None):  # each made once: the second call reads them
        key = (name, tuple(sorted((options or {}).items())))
        if key not in made:
            strategy = shardplug.get_strategy(name, **(options or {}))
            made[key] = task.trainer(strategy=strategy, mesh="stage=4,data=2", allocate=False,
                                     precision="float32")  # fmt: skip
        return made[key], next(model.batches(model.batch_size, 0))

    roomy = recommend(compile_trainer, 1 << 30, ["pp+dp"])
    assert roomy["recommended"] == "pp+dp" and roomy["options"] == {"schedule": "zb"}
    tried = roomy["strategies"][0]["schedule"]["tried"]
    assert tried["zb"]["bubble"] < tried["1f1b"]["bubble"] == tried["gpipe"]["bubble"]
    # room for the leanest schedule alone: it is the pick, though it idles more
    leanest = min(tried, key=lambda k: tried[k]["peak_bytes"])
    room = tried[leanest]["peak_bytes"] + sorted(t["peak_bytes"] for t in tried.values())[1]
    tight = recommend(compile_trainer, room // 2, ["pp+dp"])
    assert tight["options"] == {"schedule": leanest} and "do not fit" in tight["reason"]


def test_the_plugin_guides_schedule_runs():
    """docs/plugins.md, "A pipeline schedule": its blocks run, in one namespace (the guide's
    blocks of files build a package, tests/test_plugin_guide.py's), and its schedule placed
    in a V, a placement of a package's own, trains like one device."""
    import pathlib
    import re

    guide = (pathlib.Path(__file__).parent.parent / "docs" / "plugins.md").read_text()
    section = guide[guide.index("## 7. A pipeline") : guide.index("## 8. Where arrays live")]
    block = re.findall(r"```python\n(.*?)```", section, re.S)
    assert block
    namespace = {"__name__": "docs_plugins"}
    for code in block:
        exec(compile(code, "plugins.md", "exec"), namespace)
    got = _losses("pp", {"schedule": namespace["V_WRITTEN"]}, "nnx", "transformer", STEPS, 0, 4,
                  "stage=4", {"layers": 8})  # fmt: skip
    want = one_device_losses("nnx", "transformer", STEPS, 0, (("layers", 8),))
    np.testing.assert_allclose(got, want, rtol=1e-4)
