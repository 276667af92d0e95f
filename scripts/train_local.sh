#!/usr/bin/env bash
# One node: torchrun (megatron_bytescale.torchrun) starts NPROC ranks of Megatron-LM's pretrain_gpt.py with HDP flags.
#
#   MEGATRON_LM_DIR=~/Megatron-LM DATA_PATH=data/corpus MODEL=llama-7b NPROC=8 \
#       scripts/train_local.sh [extra Megatron/HDP flags]
#
# Model flags come from configs/models/$MODEL.args; every variable is in docs/cluster.md
# (DRY_RUN=1 prints the command instead of running it). Build DATA_PATH with
# `bytescale prepare-data`. With NNODES=MIN:MAX (and RDZV_ENDPOINT, SAVE_DIR, GLOBAL_BATCH_SIZE)
# it starts torchrun's elastic agent instead: run it on every node; when a node dies the others
# re-rendezvous and resume from SAVE_DIR's newest checkpoint on the smaller world.
set -euo pipefail
# shellcheck source=scripts/hdp_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/hdp_env.sh"

nproc=${NPROC:-8}
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "NPROC=$nproc: give the number of ranks (GPUs) to start on this node, e.g. NPROC=8"
hdp_args "$nproc" "$@"
if [[ -n ${NNODES:-} ]]; then  # elastic: this node's agent joins a c10d rendezvous (scripts/elastic_env.sh)
    # shellcheck source=scripts/elastic_env.sh
    source "$(dirname "${BASH_SOURCE[0]}")/elastic_env.sh"
    elastic_args "$nproc"
    run_or_print torchrun "${ELASTIC_ARGS[@]}" --nproc-per-node "$nproc" "${ENTRY[@]}" "${TRAIN_ARGS[@]}"
else
    # torchrun, with the launch checks before any rank starts and one-line rank errors (torchrun.py)
    run_or_print "${PYTHON:-python}" -m megatron_bytescale.torchrun --standalone --nproc-per-node "$nproc" "${ENTRY[@]}" "${TRAIN_ARGS[@]}"
fi
