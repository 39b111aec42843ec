"""Loading a pretrained checkpoint straight into a layout: host memory and time, against
reading the files once.

Makes a Llama-3.2-1B-shaped checkpoint (bf16, random; 2.47 GB in 4 shards with an index) if
it is not there, then in fresh processes on 8 simulated CPU devices:

- ``read once``: every shard file read into memory, start to end (the floor for any loader);
- ``fsdp load``: ``shardplug.pretrained`` placing every parameter in fsdp's layout;
- ``2 processes``: the same, by two processes of one ``jax.distributed`` job (4 devices
  each): each reads only the blocks its own devices hold.

Reported: seconds, the host's peak resident memory during the load above what the process
held before it (``VmHWM`` after resetting it), against the model's bytes and its largest
tensor, and the bytes read. On CPU the devices' arrays are host memory, so the model's bytes
are the floor; a loader that held a full copy before sharding would show twice that.

    python benchmarks/pretrained_load.py [--dir /tmp/llama-1b]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 131072, "hidden_act": "silu",
}  # fmt: skip


def make(directory: pathlib.Path) -> None:
    import ml_dtypes
    import numpy as np

    from shardplug.pretrained import read_config
    from shardplug.pretrained.safetensors import write
    from shardplug.pretrained.stored import shapes

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    config = read_config(directory)
    entries = list(shapes(config).items())  # each stored tensor and its shape
    rng = np.random.default_rng(0)
    shards = [entries[i::4] for i in range(4)]
    weight_map = {}
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00004.safetensors"

        def values(shape):
            return lambda: (0.02 * rng.standard_normal(shape, np.float32)).astype(bf16)

        write(directory / file, [(t, s, bf16, values(s)) for t, s in shard])
        weight_map.update({t: file for t, _ in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


CHILD = r"""
import json, sys, time, pathlib
import jax
if len(sys.argv) > 3:  # process i of n, port: a multi-process job, 8 devices over all of them
    import shardplug.running.distributed
    i, n, port = map(int, sys.argv[3].split("/"))
    shardplug.running.distributed.initialize(f"127.0.0.1:{port}", n, i, local_cpu_devices=8 // n)
else:
    jax.config.update("jax_num_cpu_devices", 8)

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield line.split()[0][:-1], int(line.split()[1]) * 1024

def reset():
    open("/proc/self/clear_refs", "w").write("5")

directory, what = pathlib.Path(sys.argv[1]), sys.argv[2]
if what == "read":
    files = sorted(directory.glob("*.safetensors"))
    reset(); before = dict(hwm())["VmRSS"]; start = time.perf_counter()
    total = 0
    for f in files:
        total += len(f.read_bytes())
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak": dict(hwm())["VmHWM"] - before, "read": total}))
else:
    import optax, shardplug
    from shardplug import pretrained
    model = pretrained.load(directory)
    trainer = shardplug.Trainer(model.adapter("nnx"), loss_fn=model.loss_fn,
                                optimizer=optax.sgd(0.0), strategy="fsdp", allocate=False)
    shardings = trainer.param_shardings
    reset(); before = dict(hwm())["VmRSS"]; start = time.perf_counter()
    params = model.place(shardings)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    largest = max(model.tensors.array(n).nbytes for n in model.tensors.names())
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    print(json.dumps({"seconds": seconds, "peak": dict(hwm())["VmHWM"] - before,
                      "read": model.tensors.bytes_read, "model": total, "largest": largest}))
"""


def child(directory: pathlib.Path, what: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(directory), what], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def processes(directory: pathlib.Path, count: int = 2) -> list[dict]:
    """The fsdp load by ``count`` processes of one job at once (8 devices over them)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    running = [subprocess.Popen([sys.executable, "-c", CHILD, str(directory), "load",
                                 f"{i}/{count}/{port}"], stdout=subprocess.PIPE, text=True)
               for i in range(count)]  # fmt: skip
    outs = [p.communicate()[0] for p in running]
    if any(p.returncode for p in running):
        raise SystemExit("a process of the multi-process load failed")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path("/tmp/llama-1b"))
    args = parser.parse_args()
    if not (args.dir / "model.safetensors.index.json").exists():
        make(args.dir)
    subprocess.run(
        ["cat", *map(str, args.dir.glob("*.safetensors"))], check=True, stdout=subprocess.DEVNULL
    )  # warm the page cache: both read from memory
    read, load = child(args.dir, "read"), child(args.dir, "load")
    gb = 1e9
    print(
        f"checkpoint: {load['model'] / gb:.3f} GB of parameters, largest tensor "
        f"{load['largest'] / 1e6:.1f} MB"
    )
    print(
        f"read once : {read['seconds']:.2f} s, {read['read'] / gb:.3f} GB read, host peak "
        f"+{read['peak'] / gb:.3f} GB"
    )
    print(
        f"fsdp load : {load['seconds']:.2f} s, {load['read'] / gb:.3f} GB read, host peak "
        f"+{load['peak'] / gb:.3f} GB = model x {load['peak'] / load['model']:.3f} "
        f"(model + largest tensor = x {(load['model'] + load['largest']) / load['model']:.3f})"
    )
    print(f"ratio     : load / read once = {load['seconds'] / read['seconds']:.2f} x")
    for i, one in enumerate(processes(args.dir)):
        print(
            f"2 processes, process {i}: {one['seconds']:.2f} s, {one['read'] / gb:.3f} GB read "
            f"= {one['read'] / read['read']:.3f} of the checkpoint, host peak "
            f"+{one['peak'] / gb:.3f} GB"
        )


if __name__ == "__main__":
    main()
