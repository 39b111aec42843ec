"""The frequent tier (``running/local_checkpoint.py``): each process's shards and a copy of
its predecessor's in fast local storage, restored onto any mesh, damage said and skipped.
A lost host's shards restored from its peer's copy: ``test_restarts.py``, two processes."""

import json
import os

import jax
import numpy as np
import pytest
from helpers import reference_trainer

import shardplug
from shardplug.running.checkpoint import complete_steps
from shardplug.running.local_checkpoint import LocalCheckpoints


def plain(state):
    """``state``'s arrays in host memory (PRNG keys as their data)."""
    def one(x):
        is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(x) if is_key else x)

    return [one(x) for x in jax.tree.leaves(state)]


def saved(tmp_path, saves=(2, 4, 6)):
    """A fsdp run's state on 8 devices saved in the local tier at ``saves``."""
    model, trainer = reference_trainer("mlp", "fsdp", devices=8)
    local = LocalCheckpoints(tmp_path / "local")
    states = {}
    for step in saves:
        trainer.fit(model.batches(model.batch_size, 0, start=trainer.step), step - trainer.step)
        local.save(step, trainer.state, {"data_position": step})
        states[step] = plain(trainer.state)
    local.wait()
    return model, local, states


def test_the_local_tier_restores_onto_another_mesh_bit_for_bit(tmp_path):
    _, _, states = saved(tmp_path)
    folder = tmp_path / "local" / "p0"
    assert sorted(p.name for p in folder.iterdir()) == ["4", "6"]  # the newest two
    record = json.loads((folder / "6" / "index.json").read_text())
    assert record["nprocs"] == 1 and list(record["origins"]) == ["0"]  # no peer alone
    assert complete_steps(tmp_path / "local") == [4, 6]
    _, other = reference_trainer("mlp", "dp", devices=4, checkpoint_dir=tmp_path / "p",
                                 local_checkpoint_dir=tmp_path / "local",
                                 local_checkpoint_every=2)  # fmt: skip
    assert other.restore() == 6  # the persistent tier is empty: the local one is newer
    for a, b in zip(plain(other.state), states[6], strict=True):
        np.testing.assert_array_equal(a, b)
    want = jax.tree.leaves(other.state_shardings)
    assert [x.sharding for x in jax.tree.leaves(other.state)] == want


def test_a_damaged_local_step_is_said_set_aside_and_the_one_before_used(tmp_path):
    _, local, states = saved(tmp_path, saves=(2, 4))
    data = tmp_path / "local" / "p0" / "4" / "0.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    _, other = reference_trainer("mlp", "fsdp", devices=8)
    said = "local checkpoint of step 4 .* differs from its CRC.*trying step 2"
    with pytest.warns(shardplug.ShardplugWarning, match=said):
        state, meta = local.restore(other.state, other.state_shardings)
    assert meta["step"] == 2
    assert (tmp_path / "local" / "p0" / "4.damaged").is_dir()  # moved aside, not deleted
    for a, b in zip(plain(state), states[2], strict=True):
        np.testing.assert_array_equal(a, b)


HOST = """
import sys, jax, numpy as np, optax, shardplug
from shardplug.running.distributed import initialize
from shardplug.running.local_checkpoint import LocalCheckpoints

rank, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
initialize(f"127.0.0.1:{port}", 2, rank, local_cpu_devices=2)
model = shardplug.get_model("mlp")
task = shardplug.Task(model.adapter("nnx"), model.loss_fn, optax.adam(1e-3), data=())
trainer = task.trainer(strategy="fsdp")
trainer.fit(model.batches(model.batch_size, 0), 2)
leaves = lambda s: [np.asarray(jax.experimental.multihost_utils.process_allgather(
    jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
    tiled=True)) for x in jax.tree.leaves(s)]
before = leaves(trainer.state)
local = LocalCheckpoints(f"{folder}/host{rank}")  # each host its own RAM disk
local.save(2, trainer.state, {"data_position": 2})
local.wait()
jax.experimental.multihost_utils.sync_global_devices("written")
# both hosts whole: each process lays out its own shards, onto dp's replicated layout
other = task.trainer(strategy="dp")
state, _ = LocalCheckpoints(f"{folder}/host{rank}").restore(other.state, other.state_shardings)
assert all(np.array_equal(a, b) for a, b in zip(leaves(state), before, strict=True))
assert [x.sharding for x in jax.tree.leaves(state)] == jax.tree.leaves(other.state_shardings)
# bfloat16, int8, bool, a key and host memory, split over both processes
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
on = lambda spec, kind=None: NamedSharding(mesh, spec, memory_kind=kind)
numbers = np.arange(16 * 4, dtype=np.float32).reshape(16, 4) / 7
made = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i])
odd = {"w": made(numbers.astype(jax.numpy.bfloat16), on(P("a", "b"))),
       "q": made((numbers * 3).astype(np.int8), on(P(None, "a"))),
       "mask": made(numbers > 3, on(P("b"))),
       "key": jax.random.wrap_key_data(made(np.asarray(jax.random.key_data(
           jax.random.split(jax.random.key(1), 4))), on(P()))),
       "moment": made(numbers, on(P("a"), "pinned_host"))}
store = LocalCheckpoints(f"{folder}/odd{rank}")
store.save(1, odd, {})
store.wait()
jax.experimental.multihost_utils.sync_global_devices("odd written")
into = {"w": on(P()), "q": on(P("b")), "mask": on(P(None, "a")), "key": on(P("b")),
        "moment": on(P("b"), "pinned_host")}
back, _ = store.restore(odd, into)
assert all(a.dtype == b.dtype and np.array_equal(a, b)
           for a, b in zip(leaves(back), leaves(odd), strict=True))
assert {k: v.sharding for k, v in back.items()} == into
if rank == 1:  # host 1 replaced by a new one: its RAM disk empty
    import shutil; shutil.rmtree(f"{folder}/host1/p1")
jax.experimental.multihost_utils.sync_global_devices("lost")
again = LocalCheckpoints(f"{folder}/host{rank}")
assert again.steps() == [2], again.steps()
state, meta = again.restore(trainer.state, trainer.state_shardings)
assert meta["step"] == 2 and meta["data_position"] == 2
assert all(np.array_equal(a, b) for a, b in zip(leaves(state), before, strict=True))
print("restored", rank)
"""


def test_a_host_that_lost_its_storage_restores_from_its_peers_copy(tmp_path):
    """Two processes, each host its own folder. Whole, each process lays out its own shards
    onto another mesh; every dtype and host memory too. Then host 1's folder is emptied (a
    replacement): both agree on step 2, process 0 lays out both processes' shards (its own
    and its copy of process 1's), process 1 gets the step's record from it, and the state is
    the one saved, bit for bit."""
    import subprocess
    import sys

    from shardplug.running.launch import free_port

    (tmp_path / "host.py").write_text(HOST)
    port = str(free_port())
    env = {**os.environ, "SHARDPLUG_PLUGINS": "", "JAX_PLATFORMS": "cpu"}
    workers = [subprocess.Popen([sys.executable, str(tmp_path / "host.py"), str(rank), port,
                                 str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
               for rank in (0, 1)]  # fmt: skip
    outs = [w.communicate(timeout=300) for w in workers]
    for rank, (w, (out, err)) in enumerate(zip(workers, outs, strict=True)):
        assert w.returncode == 0 and f"restored {rank}" in out, err[-3000:]
    assert not list((tmp_path / "host1" / "p1").glob("*"))  # nothing came back to it


def test_every_dtype_and_memory_round_trips(tmp_path):
    """bfloat16, int8, bool, a PRNG key and an array kept in host memory (offload's):
    written as their bytes, read back into another sharding and the same memories, bit for
    bit."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    on = lambda spec, kind=None: NamedSharding(mesh, spec, memory_kind=kind)  # noqa: E731
    numbers = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 7
    state = {
        "w": jax.device_put(numbers.astype(jnp.bfloat16), on(P("a", "b"))),
        "q": jax.device_put((numbers * 3).astype(np.int8), on(P(None, "b"))),
        "mask": jax.device_put(numbers > 20, on(P("b"))),
        "key": jax.random.split(jax.random.key(1), 4),
        "moment": jax.device_put(numbers, on(P("a"), "pinned_host")),
    }
    local = LocalCheckpoints(tmp_path)
    local.save(3, state, {})
    local.wait()
    into = {"w": on(P()), "q": on(P("a")), "mask": on(P(None, "a")), "key": on(P("a")),
            "moment": on(P("b"), "pinned_host")}  # fmt: skip
    restored, meta = local.restore(state, into)
    assert meta["step"] == 3
    for a, b in zip(plain(restored), plain(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert {k: v.sharding for k, v in restored.items()} == into
