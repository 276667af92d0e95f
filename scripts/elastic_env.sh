# shellcheck shell=bash disable=SC2034
# (SC2034: ELASTIC_ARGS is this library's output, read by its callers.)
# Elastic launches (train_local.sh and slurm/train_torchrun.sbatch with NNODES set): torchrun's
# elastic agent on every node, c10d rendezvous, restarts on whatever nodes are left. Source it
# after hdp_env.sh and call `elastic_args NPROC_PER_NODE` after `hdp_args NPROC_PER_NODE` (which
# checks that a node holds whole TP x PP groups: the job loses whole nodes): it fills
#   ELASTIC_ARGS - torchrun flags: --nnodes MIN:MAX --max-restarts --rdzv-* (no --nproc-per-node)
# and adds --load SAVE_DIR to TRAIN_ARGS, so every restart resumes from the newest checkpoint
# the run saved (Megatron's tracker file names it). Variables (docs/cluster.md):
#   NNODES          MIN:MAX nodes (or N); the job runs on any count in between, HDP on all its ranks
#   MAX_RESTARTS    restarts torchrun makes after a failure (default 3)
#   RDZV_ENDPOINT   HOST:PORT of the c10d rendezvous (one node's address; it must stay up)
#   RDZV_ID         the job's id, the same on every node (default: SLURM_JOB_ID or "hdp")
#   RDZV_CONF       extra --rdzv-conf, e.g. last_call_timeout=5 or is_host=1
#   SAVE_DIR        required: the checkpoints a restart resumes from (SAVE_INTERVAL: how often)
#   GLOBAL_BATCH_SIZE required: sequences per step, divisible by every HDP size the job may get

elastic_args() {
    local nproc=$1
    local tp=${TP:-1} pp=${PP:-1}
    [[ ${NNODES:-} =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] ||
        die "NNODES=${NNODES:-}: give MIN:MAX nodes for an elastic run (e.g. NNODES=2:4), or a node count"
    local min=${NNODES%%:*} max=${NNODES##*:}
    ((min <= max)) || die "NNODES=$NNODES: the minimum $min is above the maximum $max"
    [[ ${MAX_RESTARTS:-3} =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=$MAX_RESTARTS: give a whole number of restarts, e.g. 3"
    [[ -n ${RDZV_ENDPOINT:-} ]] || die "set RDZV_ENDPOINT=HOST:PORT for the c10d rendezvous (a node every agent reaches)"
    [[ -n ${SAVE_DIR:-} ]] ||
        die "an elastic run resumes from its own checkpoints after a restart: set SAVE_DIR (and SAVE_INTERVAL)"
    [[ -n ${GLOBAL_BATCH_SIZE:-} ]] ||
        die "an elastic run keeps its global batch on any world: set GLOBAL_BATCH_SIZE (divisible by every HDP size from $((min * nproc / (tp * pp))) to $((max * nproc / (tp * pp))))"
    [[ -z ${LOAD_DIR:-} || $LOAD_DIR == "$SAVE_DIR" ]] ||
        die "LOAD_DIR=$LOAD_DIR: an elastic run restarts from SAVE_DIR=$SAVE_DIR; copy the checkpoint there and unset LOAD_DIR"
    [[ -n ${LOAD_DIR:-} ]] || TRAIN_ARGS+=(--load "$SAVE_DIR")
    # torchrun's rank-0 agent otherwise serves its workers one TCP store for every round, and
    # the keys of the round before (gloo's rank addresses) are still in it after a restart: the
    # new ranks connect to dead peers. Without sharing, rank 0 of each round starts a fresh store.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    ELASTIC_ARGS=(--nnodes "$NNODES" --max-restarts "${MAX_RESTARTS:-3}" --rdzv-backend c10d
        --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-hdp}}")
    [[ -z ${RDZV_CONF:-} ]] || ELASTIC_ARGS+=(--rdzv-conf "$RDZV_CONF")
}
