#!/usr/bin/env bash
# Run a command as one torch.distributed rank of a Slurm job step: RANK, WORLD_SIZE,
# LOCAL_RANK and LOCAL_WORLD_SIZE from Slurm's task variables, MASTER_ADDR / MASTER_PORT
# from the batch script (or derived here). Used by train_srun.sbatch:
#   srun --ntasks-per-node=8 scripts/slurm/srun_rank_env.sh python pretrain_gpt.py ...
set -euo pipefail

: "${SLURM_PROCID:?run this under srun}"
export RANK=$SLURM_PROCID
export WORLD_SIZE=${SLURM_NTASKS:?}
export LOCAL_RANK=${SLURM_LOCALID:?}
# SLURM_NTASKS_PER_NODE is a plain count with --ntasks-per-node; SLURM_TASKS_PER_NODE may read "8(x4)"
tasks_per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:?}}
export LOCAL_WORLD_SIZE=${tasks_per_node%%(*}
if [[ -z ${MASTER_ADDR:-} ]]; then
    hosts=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}")  # no "| head": SIGPIPE under pipefail
    MASTER_ADDR=${hosts%%$'\n'*}
fi
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
exec "$@"
