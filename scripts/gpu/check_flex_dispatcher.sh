#!/usr/bin/env bash
# GPU check of the flex MoE token dispatcher under HDP (DeepEP / HybridEP): the tiny MoE model,
# expert parallelism 2 on 2 HDP ranks (one EP group), 3 iterations of pretrain_gpt.py through
# the launcher, once with the all-to-all dispatcher and once with flex; both must train to the
# end with finite losses, and the losses must agree to bf16 rounding (the dispatchers move the
# same tokens to the same experts; the CPU tests prove the all-to-all run exact).
#
# Needs at least 2 CUDA GPUs on one node (DeepEP keeps one communication buffer per rank on its
# own device, so the one-GPU machine of scripts/gpu/ cannot run it) and the deep_ep package
# (`--moe-flex-dispatcher-backend hybridep` also comes from it: BACKEND=hybridep).
#
#   MEGATRON_LM_DIR=... scripts/gpu/check_flex_dispatcher.sh    (results: $OUT/flex.json, two logs)
# DRY_RUN=1 prints the two training commands and runs nothing (no GPU needed).
set -euo pipefail
# shellcheck source=scripts/gpu/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
backend=${BACKEND:-deepep}

common=(MODEL=tiny-moe SEQ_LENGTH=2048 HDP_TOKEN_CAPACITY=2048 HDP_STEP_TOKENS=8K GLOBAL_BATCH_SIZE=2
        LR=1e-3 LR_WARMUP_ITERS=0 TRAIN_ITERS=3 TRANSFORMER_IMPL=local LOG_INTERVAL=1 NPROC=2
        HDP_HARDWARE=h100 DATA_PATH="$work/corpus" MEGATRON_LM_DIR="$mlm")
moe=(--expert-model-parallel-size 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
     --no-gradient-accumulation-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion)
alltoall=(--moe-token-dispatcher-type alltoall)
flex=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend "$backend")
if [[ ${DRY_RUN:-0} == 1 ]]; then
    env "${common[@]}" DRY_RUN=1 bash "$repo/scripts/train_local.sh" "${moe[@]}" "${alltoall[@]}"
    env "${common[@]}" DRY_RUN=1 bash "$repo/scripts/train_local.sh" "${moe[@]}" "${flex[@]}"
    exit 0
fi

"$python" -c "
import importlib.util, sys, torch
gpus = torch.cuda.device_count()
gpus >= 2 or sys.exit(f'error: the flex dispatcher check needs 2 CUDA GPUs on this node, found {gpus}')
importlib.util.find_spec('deep_ep') or sys.exit('error: the flex dispatcher needs DeepEP: install deep_ep')
print('torch', torch.__version__, gpus, 'x', torch.cuda.get_device_name())"

# a corpus of this repository's own source files, one document per file (no network)
PYTHONPATH="$repo" "$python" -m megatron_bytescale.cli prepare-data --output "$work/corpus" --repos "$repo" > /dev/null

run() {  # NAME FLAGS...: train, keep the log, print its lm losses
    local name=$1
    shift
    env "${common[@]}" bash "$repo/scripts/train_local.sh" "${moe[@]}" "$@" > "$out/$name.log" 2>&1 ||
        { tail -5 "$out/$name.log" >&2; echo "error: the $name run failed (log: $out/$name.log)" >&2; exit 1; }
    grep -o "lm loss: [0-9.E+-]*" "$out/$name.log" | awk '{print $3}'
}
mapfile -t reference < <(run alltoall "${alltoall[@]}")
mapfile -t flexed < <(run flex "${flex[@]}")
"$python" - "$out/flex.json" "$backend" "${reference[*]}" "${flexed[*]}" << 'EOF'
import json, math, sys
path, backend, reference, flexed = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
reference, flexed = [float(x) for x in reference], [float(x) for x in flexed]
ok = len(reference) == len(flexed) == 3 and all(math.isfinite(x) for x in reference + flexed)
worst = max((abs(a - b) / max(abs(a), 1e-6) for a, b in zip(reference, flexed)), default=math.inf)
ok = ok and worst < 2e-2  # bf16 rounding of the expert GEMMs' inputs, in another order
json.dump({"backend": backend, "alltoall": reference, "flex": flexed, "worst_rel": worst, "ok": ok}, open(path, "w"), indent=1)
print(f"flex ({backend}) {flexed} against alltoall {reference}: worst relative difference {worst:.2e}: {'ok' if ok else 'FAILS'}")
sys.exit(0 if ok else 1)
EOF
