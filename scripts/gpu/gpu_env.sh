# shellcheck shell=bash disable=SC2034
# Sourced by the Megatron-LM GPU checks of scripts/gpu/: sets repo (this checkout), mlm (the
# Megatron-LM source: MEGATRON_LM_DIR, else what prepare_smoke.sh copied), out (results: OUT, else
# a temporary folder), work (scratch, removed at exit) and python (PYTHON, else python3).
# (SC2034: the variables are the sourcing script's.)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mlm=$(cd "${MEGATRON_LM_DIR:-$repo/.smoke/Megatron-LM}" 2>/dev/null && pwd) ||
    { echo "error: no Megatron-LM source: run scripts/gpu/prepare_smoke.sh first or set MEGATRON_LM_DIR" >&2; exit 2; }
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
