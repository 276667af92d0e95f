#!/usr/bin/env bash
# GPU smoke test (one GPU, a few minutes): Megatron-LM (core_v0.16.1 or core_v0.19.x) trains a tiny GPT for a
# few iterations of pretrain_gpt.py with --hybrid-data-parallel, on a tiny dataset made here
# from this repository's own source files (no network):
#   1. patched: a copy of the checkout with its era's patch series applied (patches/core_v0.16/
#      or patches/core_v0.19/, chosen by `bytescale patches`); 4 iterations, validation,
#      a checkpoint;
#   2. launcher: the unpatched checkout under `python -m megatron_bytescale.launch`, resuming
#      that checkpoint for 2 more iterations (the HDP loader fast-forwards past 4 steps).
# Each must reach its last iteration with finite losses (exact resume is checked by the CPU
# tests, tests/test_pretrain_gpt_cpu.py). Needs a CUDA GPU, torch, and what Megatron-LM's training package imports
# (`pip install -e '.[megatron]'`: six, pydantic, einops, regex, psutil; triton comes with CUDA
# torch); not flash-attn, Transformer Engine or apex (--transformer-impl local, no fused
# kernels; without apex/TE megatron-core's distributed optimizer falls back to torch Adam, whose
# resume megatron_bytescale/megatron/cpu_compat.py fixes on any device).
#
#   MEGATRON_LM_DIR=... scripts/gpu/smoke_pretrain_gpt.sh    (default .smoke/Megatron-LM,
#                                                            made by scripts/gpu/prepare_smoke.sh)
# Results: $OUT/smoke.json and the two logs (OUT defaults to a temporary folder).
# DRY_RUN=1 prints the two training commands and runs nothing (no GPU needed).
set -euo pipefail
# shellcheck source=scripts/gpu/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

common=(MODEL=tiny SEQ_LENGTH=2048 HDP_TOKEN_CAPACITY=2048 HDP_STEP_TOKENS=8K GLOBAL_BATCH_SIZE=1
        LR=1e-3 MIN_LR=1e-4 LR_WARMUP_ITERS=1 TRANSFORMER_IMPL=local LOG_INTERVAL=1 HDP_HARDWARE=h200
        DATA_PATH="$work/train" VALID_DATA_PATH="$work/valid" EVAL_ITERS=1 EVAL_INTERVAL=2
        SAVE_DIR="$work/ckpt" SAVE_INTERVAL=4)
no_fusion=(--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion
           --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm --ckpt-format torch
           --distributed-timeout-minutes 5)
if [[ ${DRY_RUN:-0} == 1 ]]; then
    env "${common[@]}" MEGATRON_LM_DIR="$mlm" HDP_MODE=patched TRAIN_ITERS=4 NPROC=1 \
        bash "$repo/scripts/train_local.sh" "${no_fusion[@]}"
    env "${common[@]}" MEGATRON_LM_DIR="$mlm" HDP_MODE=launcher TRAIN_ITERS=6 NPROC=1 LOAD_DIR="$work/ckpt" \
        bash "$repo/scripts/train_local.sh" "${no_fusion[@]}"
    exit 0
fi

"$python" -c "import sys, torch; torch.cuda.is_available() or sys.exit('error: no CUDA device: this smoke test needs a GPU'); print('torch', torch.__version__, torch.cuda.get_device_name())"
"$python" -c "
import importlib.util, sys
missing = [m for m in ('six', 'pydantic', 'einops', 'regex', 'psutil', 'triton') if importlib.util.find_spec(m) is None]
missing and sys.exit('error: Megatron-LM training needs ' + ', '.join(missing) + \": pip install -e '.[megatron]'\" + (' (and triton)' if 'triton' in missing else ''))"

# 1. trees: pristine (launcher) and patched copies; dataset helpers compiled or stubbed
cp -r "$mlm" "$work/pristine"
cp -r "$mlm" "$work/patched"
# the series for this checkout's megatron-core (core_v0.16 or core_v0.19), applied in order
PYTHONPATH="$repo" "$python" -m megatron_bytescale.cli patches "$work/patched" --apply
grep -q "pretrain_hooks as hdp" "$work/patched/pretrain_gpt.py"
for tree in "$work/pristine" "$work/patched"; do
    # Megatron runs `make` for its C++ dataset helpers at start-up: build them, or take the
    # compiled module the megatron-core wheel of the same release ships (docs/cluster.md)
    if ! make -s -C "$tree/megatron/core/datasets" >/dev/null 2>&1; then
        "$python" -c "import importlib.metadata as m; print(next(f.locate() for f in m.files('megatron-core') if f.name.startswith('helpers_cpp')))" |
            xargs -I{} cp {} "$tree/megatron/core/datasets/"
        echo "note: dataset helpers taken from the megatron-core wheel in $tree"
    fi
done

# 2. data: one document per source file of this repository, byte-level tokens
PYTHONPATH="$mlm:$repo" "$python" - "$work" "$repo" <<'PY'
import sys
from pathlib import Path
from megatron_bytescale.data.corpus import text_file_documents
from megatron_bytescale.data.indexed import write_indexed_dataset
work, repo = Path(sys.argv[1]), Path(sys.argv[2])
files = sorted(p for p in (repo / "megatron_bytescale").rglob("*.py") if p.stat().st_size > 0)
for name, part in (("train", files[1::4] + files[2::4] + files[3::4]), ("valid", files[0::4])):
    info = write_indexed_dataset(work / name, text_file_documents(part), source="repository source")
    print(name, info)
PY

# 3. runs
status=0
run() {  # run NAME TREE MODE ITERS [VAR=VALUE...]
    local name=$1 tree=$2 mode=$3 iters=$4 start=$SECONDS rc=0
    shift 4
    echo "=== $name: $mode, $iters iterations"
    env "${common[@]}" "$@" MEGATRON_LM_DIR="$tree" HDP_MODE="$mode" TRAIN_ITERS="$iters" NPROC=1 \
        timeout 300 bash "$repo/scripts/train_local.sh" "${no_fusion[@]}" >"$out/$name.log" 2>&1 || rc=$?
    "$python" - "$out/$name.log" "$name" "$iters" "$rc" "$((SECONDS - start))" "$out/$name.json" <<'PY' || status=1
import json, math, re, sys
log, name, iters, rc, secs, dest = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
text = open(log, errors="replace").read()
done = [int(m) for m in re.findall(r"iteration\s+(\d+)/\s*\d+", text)]
losses = [float(x) for x in re.findall(r"lm loss: ([0-9.eE+-]+)", text)]
valid = [float(x) for x in re.findall(r"lm loss value: ([0-9.eE+-]+)", text)]
ok = rc == 0 and done and max(done) == iters and losses and all(math.isfinite(x) for x in losses + valid)
result = {"run": name, "ok": bool(ok), "rc": rc, "seconds": secs, "last_iteration": max(done) if done else None,
          "train_losses": losses, "valid_losses": valid}
json.dump(result, open(dest, "w"), indent=1)
print(json.dumps(result))
if not ok:
    print("\n".join(text.splitlines()[-40:]))
    sys.exit(1)
PY
}
run patched "$work/patched" patched 4
run launcher "$work/pristine" launcher 6 LOAD_DIR="$work/ckpt"
"$python" - "$out" <<'PY'
import json, sys
from pathlib import Path
runs = [json.loads((Path(sys.argv[1]) / f"{n}.json").read_text()) for n in ("patched", "launcher") if (Path(sys.argv[1]) / f"{n}.json").exists()]
json.dump({"ok": len(runs) == 2 and all(r["ok"] for r in runs), "runs": runs}, open(Path(sys.argv[1]) / "smoke.json", "w"), indent=1)
PY
echo "smoke: $([[ $status == 0 ]] && echo PASSED || echo FAILED) (details in $out/smoke.json)"
exit "$status"
