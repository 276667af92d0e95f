# shellcheck shell=bash disable=SC2034
# (SC2034: MODEL_ARGS, TRAIN_ARGS and ENTRY are this library's output, read by its callers.)
# Shared by the launch scripts (train_local.sh, slurm/*.sbatch): builds, from environment
# variables, the pretrain_gpt.py command line of an HDP run. Source it; it defines
#   TRAIN_ARGS  - Megatron flags (model from configs/models/$MODEL.args) + HDP flags + "$@"
#   ENTRY       - what python/torchrun runs: pretrain_gpt.py itself (patched checkout) or
#                 "-m megatron_bytescale.launch pretrain_gpt.py" (unpatched checkout)
# and exports PYTHONPATH and CUDA_DEVICE_MAX_CONNECTIONS. Every variable is listed in
# docs/cluster.md; the required ones are MEGATRON_LM_DIR and DATA_PATH.

HDP_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() {
    echo "error: $*" >&2
    exit 2
}

# Megatron flags from a configs/models/<name>.args file (or a path): '#' starts a comment.
read_model_args() {
    local spec=$1 file line
    local -a words
    if [[ -f $spec ]]; then
        file=$spec
    elif [[ -f $HDP_REPO_ROOT/configs/models/$spec.args ]]; then
        file=$HDP_REPO_ROOT/configs/models/$spec.args
    else
        local names=() f
        for f in "$HDP_REPO_ROOT"/configs/models/*.args; do
            f=${f##*/}
            names+=("${f%.args}")
        done
        die "unknown model '$spec': use a name from configs/models/ (${names[*]}) or a path to a .args file"
    fi
    MODEL_ARGS=()
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line%%#*}
        read -ra words <<<"$line"
        MODEL_ARGS+=("${words[@]}")
    done <"$file"
}

# The HDP_* variables these scripts read (docs/cluster.md lists each); any other HDP_* variable
# in the environment is a misspelling, refused rather than ignored.
HDP_VARIABLES=(HDP_TOKEN_CAPACITY HDP_STEP_TOKENS HDP_BALANCE HDP_SELECTIVE_OFFLOAD HDP_PROFILE HDP_HARDWARE
    HDP_DATALOADER HDP_RAY_ADDRESS HDP_PLAN_AHEAD HDP_MODE)

check_hdp_variables() {
    local name known
    for name in $(compgen -e); do
        [[ $name == HDP_* ]] || continue
        for known in "${HDP_VARIABLES[@]}"; do
            [[ $name == "$known" ]] && continue 2
        done
        die "$name is not a variable of these scripts (a misspelling?); they read ${HDP_VARIABLES[*]}"
    done
}

# positive_int NAME VALUE: die unless VALUE is a positive whole number
positive_int() {
    [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1=$2: give a positive whole number"
}

# hdp_args WORLD_SIZE [extra flags...]: fill TRAIN_ARGS and ENTRY.
hdp_args() {
    local world_size=$1
    shift
    check_hdp_variables
    [[ -n ${MEGATRON_LM_DIR:-} ]] || die "set MEGATRON_LM_DIR to a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.x"
    [[ -f $MEGATRON_LM_DIR/pretrain_gpt.py ]] || die "$MEGATRON_LM_DIR/pretrain_gpt.py not found: MEGATRON_LM_DIR must be a Megatron-LM checkout"
    [[ -n ${DATA_PATH:-} ]] || die "set DATA_PATH to an indexed dataset prefix (build one with: bytescale prepare-data --output PREFIX ...)"
    [[ $DATA_PATH != *.bin && $DATA_PATH != *.idx ]] ||
        die "DATA_PATH=$DATA_PATH: give the dataset prefix, without .bin/.idx (DATA_PATH=${DATA_PATH%.*})"
    # (not on a dry run: the data may live only where the job runs)
    [[ ${DRY_RUN:-0} == 1 || (-f $DATA_PATH.bin && -f $DATA_PATH.idx) ]] ||
        die "DATA_PATH=$DATA_PATH: $DATA_PATH.bin and .idx not found; build them with: bytescale prepare-data --output $DATA_PATH ..."
    [[ ${HDP_TOKEN_CAPACITY:-8K} =~ ^[0-9]+(\.[0-9]+)?[KkMm]?$ && ${HDP_TOKEN_CAPACITY:-8K} =~ [1-9] ]] ||
        die "HDP_TOKEN_CAPACITY=$HDP_TOKEN_CAPACITY: write tokens per rank and micro-batch (more than 0) with an optional K/M suffix, e.g. 8K"
    [[ ${HDP_PLAN_AHEAD:-2} =~ ^[0-9]+$ ]] ||
        die "HDP_PLAN_AHEAD=$HDP_PLAN_AHEAD: give how many steps to plan ahead, a whole number >= 0 (e.g. 2)"
    local iters=${TRAIN_ITERS:-1000} warmup=${LR_WARMUP_ITERS:-100}
    [[ $iters =~ ^[1-9][0-9]*$ ]] || die "TRAIN_ITERS=$iters: give the number of training iterations, a positive integer"
    [[ $warmup =~ ^[0-9]+$ ]] || die "LR_WARMUP_ITERS=$warmup: give a whole number of warm-up iterations"
    ((warmup < iters)) ||
        die "LR_WARMUP_ITERS=$warmup is not below TRAIN_ITERS=$iters: the learning rate would never decay; lower LR_WARMUP_ITERS (e.g. $((iters / 10))) or raise TRAIN_ITERS"
    [[ ${HDP_SELECTIVE_OFFLOAD:-0} == [01] ]] || die "HDP_SELECTIVE_OFFLOAD must be 0 or 1, got '$HDP_SELECTIVE_OFFLOAD'"
    [[ -z ${HDP_PROFILE:-} || -f $HDP_PROFILE ]] ||
        die "HDP_PROFILE=$HDP_PROFILE: no such file; measure one with bytescale profile, or unset it for the analytic model"

    local tp=${TP:-1} pp=${PP:-1}
    [[ $pp =~ ^[1-9][0-9]*$ ]] || die "PP=$pp: give the number of pipeline stages, a positive integer (e.g. PP=2)"
    positive_int TP "$tp"
    positive_int SEQ_LENGTH "${SEQ_LENGTH:-32768}"
    positive_int LOG_INTERVAL "${LOG_INTERVAL:-10}"
    [[ -z ${GLOBAL_BATCH_SIZE:-} ]] || positive_int GLOBAL_BATCH_SIZE "$GLOBAL_BATCH_SIZE"
    [[ -z ${SAVE_DIR:-} ]] || positive_int SAVE_INTERVAL "${SAVE_INTERVAL:-1000}"
    [[ -z ${VALID_DATA_PATH:-} ]] || positive_int EVAL_INTERVAL "${EVAL_INTERVAL:-500}"
    case ${TRANSFORMER_IMPL:-transformer_engine} in
        local | transformer_engine) ;;
        *) die "TRANSFORMER_IMPL must be local or transformer_engine, got '${TRANSFORMER_IMPL}'" ;;
    esac
    ((world_size % (tp * pp) == 0)) || die "world size $world_size does not divide by TP=$tp x PP=$pp"
    local dp=$((world_size / (tp * pp)))
    local seq=${SEQ_LENGTH:-32768}

    read_model_args "${MODEL:-llama-7b}"
    TRAIN_ARGS=(
        "${MODEL_ARGS[@]}"
        --tensor-model-parallel-size "$tp"
        --pipeline-model-parallel-size "$pp"
        --seq-length "$seq"
        --max-position-embeddings "$seq"
        --micro-batch-size 1
        --global-batch-size "${GLOBAL_BATCH_SIZE:-$dp}"
        --train-iters "${TRAIN_ITERS:-1000}"
        --lr "${LR:-3e-4}"
        --min-lr "${MIN_LR:-3e-5}"
        --lr-decay-style cosine
        --lr-warmup-iters "${LR_WARMUP_ITERS:-100}"
        --weight-decay 0.1
        --clip-grad 1.0
        --use-distributed-optimizer
        --calculate-per-token-loss
        --attention-dropout 0.0
        --transformer-impl "${TRANSFORMER_IMPL:-transformer_engine}"
        --tokenizer-type NullTokenizer
        --log-interval "${LOG_INTERVAL:-10}"
        --hybrid-data-parallel
        --hdp-token-capacity "${HDP_TOKEN_CAPACITY:-8K}"
        --hdp-dataloader "${HDP_DATALOADER:-local}"
        --hdp-plan-ahead "${HDP_PLAN_AHEAD:-2}"
    )
    # PRECISION: bf16 (default), fp16, or fp32 (CPU runs and exactness checks)
    case ${PRECISION:-bf16} in
        bf16) TRAIN_ARGS+=(--bf16) ;;
        fp16) TRAIN_ARGS+=(--fp16) ;;
        fp32) ;;
        *) die "PRECISION must be bf16, fp16 or fp32, got '${PRECISION}'" ;;
    esac
    # fused RoPE, the persistent LayerNorm and fused weight-gradient accumulation are TE/Apex
    # kernels: the local implementation (torch norms, PyTorch rotation) refuses them
    [[ ${TRANSFORMER_IMPL:-transformer_engine} == local ]] && TRAIN_ARGS+=(--no-rope-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion)
    # Megatron takes either --data-path or per-split paths, not both
    if [[ -n ${VALID_DATA_PATH:-} ]]; then
        TRAIN_ARGS+=(--train-data-path "$DATA_PATH" --valid-data-path "$VALID_DATA_PATH"
            --eval-iters "${EVAL_ITERS:-10}" --eval-interval "${EVAL_INTERVAL:-500}")
    else
        # Megatron divides --train-iters by --eval-interval even with --eval-iters 0
        TRAIN_ARGS+=(--data-path "$DATA_PATH" --eval-iters 0 --eval-interval "${EVAL_INTERVAL:-${TRAIN_ITERS:-1000}}")
    fi
    [[ -n ${HDP_STEP_TOKENS:-} ]] && TRAIN_ARGS+=(--hdp-step-tokens "$HDP_STEP_TOKENS")
    [[ -n ${HDP_BALANCE:-} ]] && TRAIN_ARGS+=(--hdp-balance "$HDP_BALANCE")
    [[ ${HDP_SELECTIVE_OFFLOAD:-0} == 1 ]] && TRAIN_ARGS+=(--hdp-selective-offload)
    # neither: the planner's cost model follows the device (h100 on GPUs, the shipped CPU profile without CUDA)
    if [[ -n ${HDP_PROFILE:-} ]]; then
        TRAIN_ARGS+=(--hdp-profile "$HDP_PROFILE")
    elif [[ -n ${HDP_HARDWARE:-} ]]; then
        TRAIN_ARGS+=(--hdp-hardware "$HDP_HARDWARE")
    fi
    [[ -n ${HDP_RAY_ADDRESS:-} ]] && TRAIN_ARGS+=(--hdp-ray-address "$HDP_RAY_ADDRESS")
    [[ -n ${SAVE_DIR:-} ]] && TRAIN_ARGS+=(--save "$SAVE_DIR" --save-interval "${SAVE_INTERVAL:-1000}")
    [[ -n ${LOAD_DIR:-} ]] && TRAIN_ARGS+=(--load "$LOAD_DIR")
    TRAIN_ARGS+=("$@")

    # patched checkout (`bytescale patches DIR --apply`): run pretrain_gpt.py; otherwise the launcher
    local mode=${HDP_MODE:-auto}
    if [[ $mode == auto ]]; then
        if grep -q "megatron_bytescale.megatron import pretrain_hooks" "$MEGATRON_LM_DIR/pretrain_gpt.py"; then
            mode=patched
        else
            mode=launcher
        fi
    fi
    case $mode in
        patched) ENTRY=("$MEGATRON_LM_DIR/pretrain_gpt.py") ;;
        launcher) ENTRY=(-m megatron_bytescale.launch "$MEGATRON_LM_DIR/pretrain_gpt.py") ;;
        *) die "HDP_MODE must be auto, patched or launcher, got '$mode'" ;;
    esac

    export PYTHONPATH="$MEGATRON_LM_DIR:$HDP_REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export CUDA_DEVICE_MAX_CONNECTIONS=1
}

# run_or_print CMD...: run it in place of this shell (a signal to the script reaches the launcher
# itself, and the ranks die with it), or print it (one shell-quoted line) when DRY_RUN=1.
run_or_print() {
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        printf '%q ' "$@"
        printf '\n'
    else
        exec "$@"
    fi
}

# preflight WORLD_SIZE: the launcher's checks of TRAIN_ARGS (validate_hdp_args, LR schedule,
# dataset, --save lock) before srun starts any rank; one line and exit 2 on bad input. Not on a
# dry run (the data may live only where the job runs).
preflight() {
    [[ ${DRY_RUN:-0} == 1 ]] && return 0
    "${PYTHON:-python}" -m megatron_bytescale.megatron.preflight --world-size "$1" "${ENTRY[@]}" "${TRAIN_ARGS[@]}" || exit 2
}
