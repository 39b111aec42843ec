#!/usr/bin/env bash
# What the issues ask of one H100, in one run (about 9 minutes): the 1B GPT of
# benchmarks/gpu_mfu.py (batch 16 x 1024, bf16 compute, AdamW) plain and under each offload
# mode, with --remat full plain and offloaded, LoRA and QLoRA at rank 16, and float8
# (per tensor and per row); each against
# the hand-written plain (full fine-tune) step
# in the same process (its "ratio"), each with its predicted and measured device peak.
# Each writes benchmarks/gpu/h100_<case>.json (or under $OUT when it is set), which
# benchmarks/target_memory.py reads to put the CPU-compiled prediction beside the measure.
#
#   bash benchmarks/gpu/check.sh            # from the repository's root, on the GPU machine
#   SIZE=smoke bash benchmarks/gpu/check.sh # a tiny GPT, anywhere (tests/test_benchmarks.py)
set -uo pipefail
failed=0
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dest="${OUT:-benchmarks/gpu}"
size="${SIZE:-1b}"
mkdir -p "$dest"
run() {  # NAME ARGS...: one mode in a process of its own (its peak is its own)
    local name=$1; shift
    echo "== $name: $*"
    # written whole or not at all: a failed run leaves its .err, never an empty .json
    if timeout 150 "${PYTHON:-python3}" benchmarks/gpu_mfu.py --size "$size" --steps 5 --rounds 3 "$@" \
        > "$dest/.h100_$name.part" 2> "$dest/h100_$name.err" \
        && mv "$dest/.h100_$name.part" "$dest/h100_$name.json"; then
        "${PYTHON:-python3}" - "$dest/h100_$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
gb = lambda b: "none" if b is None else f"{b / 1e9:.2f} GB"
ms = lambda s: "none" if s is None else f"{s * 1e3:.1f} ms"
print(f"   step {r['shardplug']['step_seconds'] * 1e3:.1f} ms (predicted "
      f"{ms(r.get('predicted_step_seconds'))}), x plain hand-written "
      f"{r['ratio']:.3f}, peak measured {gb(r['measured_peak_bytes'])}, "
      f"predicted {gb(r['predicted_peak_bytes'])}, loss {r['loss']:.4f}")
PY
    else
        rm -f "$dest/.h100_$name.part"
        echo "   failed: $(grep -v '^\s*$' "$dest/h100_$name.err" | tail -1)"
        failed=1
    fi
}
run "$size-plain"
run "$size-offload" --addon offload
run "$size-offload-params" --addon offload -o offload.params=true
run "$size-offload-update-host" --addon offload -o offload.update=host -o offload.params=true
run "$size-remat-full" --remat full
run "$size-remat-full-offload" --remat full --addon offload
# LoRA beside the frozen weight: its step against the hand-written full step ("ratio")
run "$size-lora16" --lora 16
run "$size-qlora16-nf4" --lora 16 --lora-quantize nf4
# float8 products (e4m3 forward, e5m2 gradients): against the hand-written bf16 step
run "$size-float8" --addon float8
run "$size-float8-row" --addon float8 -o float8.scaling=row
run "$size-remat-offload" --remat offload
# pp's engines on one stage, each against accumulation (the engine changed since the record)
if [ "$size" != smoke ]; then
    for m in 8 16; do
        echo "== pipeline engine, M = $m"
        if timeout 200 "${PYTHON:-python3}" benchmarks/pipeline_engine.py --size 350m \
            --batch $((2 * m)) --microbatches "$m" --rounds 3 --precision bf16 \
            > "$dest/.h100_pipeline_engine_350m_m$m.part"; then
            mv "$dest/.h100_pipeline_engine_350m_m$m.part" "$dest/h100_pipeline_engine_350m_m$m.json"
        else
            rm -f "$dest/.h100_pipeline_engine_350m_m$m.part"; failed=1
        fi
    done
fi
# then, on any machine with shardplug[target]: python benchmarks/target_time.py --out
# benchmarks/gpu/h100_target_time.json puts each step predicted beside these measures
exit $failed
