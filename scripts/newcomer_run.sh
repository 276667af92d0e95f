#!/usr/bin/env bash
# A new user's first contact, repeatable: a fresh clone, a fresh virtual environment, the
# README's install line, then the README's commands in order. Each step prints how long it took
# and the longest stretch it stayed silent (no new line or progress update on the terminal),
# so waits without a word show up. Everything each step printed is kept under WORKDIR/logs/.
#
#   scripts/newcomer_run.sh [PYTHON] [WORKDIR]      # e.g. python3.12 /tmp/newcomer-312
#
# TORCH_INSTALL replaces the README's torch install line where PyTorch's CPU index cannot be
# reached (e.g. TORCH_INSTALL="pip install torch==2.13.0" with a local CPU wheel);
# MEGATRON_LM_DIR adds `bytescale demo --megatron-lm`; STEPS=quick skips the two long runs
# (the demo's training and the headline simulation).
set -euo pipefail
PYTHON=${1:-python3}
WORKDIR=$(mkdir -p "${2:-/tmp/bytescale-newcomer}" && cd "${2:-/tmp/bytescale-newcomer}" && pwd)
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
TORCH_INSTALL=${TORCH_INSTALL:-pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu}
LOGS=$WORKDIR/logs
rm -rf "$WORKDIR/clone" "$LOGS"
mkdir -p "$LOGS"
SUMMARY=$LOGS/summary.txt

# Runs "$@" with its output time-stamped: prints the step's wall time and its longest silence
# (output split at newlines and carriage returns, so a progress bar's updates count as words).
step() {
    local name=$1
    shift
    echo "== $name: $*"
    local start=$SECONDS rc
    set +e
    "$@" 2>&1 | "$PYTHON" -u -c '
import sys, time
last = time.monotonic(); gap = 0.0; tail = b""; where = b""
out = open(sys.argv[1], "wb")
while True:
    chunk = sys.stdin.buffer.read1(4096)
    if not chunk:
        break
    now = time.monotonic()
    if any(c in chunk for c in (b"\n", b"\r")):
        if now - last > gap:
            gap, where = now - last, tail
        last = now
    tail = (tail + chunk).replace(b"\r", b"\n").rstrip(b"\n").rsplit(b"\n", 1)[-1][-100:]
    out.write(chunk); sys.stdout.buffer.write(chunk); sys.stdout.buffer.flush()
if time.monotonic() - last > gap:
    gap, where = time.monotonic() - last, tail
text = where.decode(errors="replace").strip()
print(f"longest silence {gap:.1f} s" + (f" after \"{text}\"" if text else ""), file=open(sys.argv[2], "w"))
' "$LOGS/$name.log" "$LOGS/$name.gap"
    rc=${PIPESTATUS[0]}
    set -e
    local line
    line="$name: $((SECONDS - start)) s, $(cat "$LOGS/$name.gap"), exit $rc"
    echo "-- $line"
    echo "$line" >> "$SUMMARY"
}

git clone -q "$REPO" "$WORKDIR/clone"
cd "$WORKDIR/clone"
echo "clone of $(git -C "$REPO" rev-parse --short HEAD) with $("$PYTHON" --version)" | tee "$SUMMARY"

step venv "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
# shellcheck disable=SC2086
step install-torch $TORCH_INSTALL
step install-package pip install -e '.[test]'
du -sh .venv | sed 's/^/environment size: /' | tee -a "$SUMMARY"
echo "CUDA packages installed: $(pip list 2>/dev/null | grep -ciE '^(nvidia-|triton)' || true)" | tee -a "$SUMMARY"

step help bytescale --help
for command in demo verify plan simulate profile prepare-data dataloader-bench patches; do
    step "help-$command" bytescale "$command" --help
done
if [[ ${STEPS:-full} != quick ]]; then
    step demo bytescale demo
    step simulate bytescale simulate
fi
step verify bytescale verify
step prepare-data bytescale prepare-data --output data/corpus --text-files README.md docs/design.md docs/cluster.md
if [[ -n ${MEGATRON_LM_DIR:-} ]]; then
    pip install -q -e '.[test,megatron]'
    step demo-megatron-lm bytescale demo --megatron-lm "$MEGATRON_LM_DIR" --steps 10
fi
git status --porcelain | sed 's/^/left untracked in the clone: /' | tee -a "$SUMMARY"
echo
cat "$SUMMARY"
