#!/usr/bin/env bash
# Put what the GPU smoke test needs and the GPU machine lacks into .smoke/ (git-ignored):
# Megatron-LM's training code at tag $MEGATRON_LM_TAG (default core_v0.16.1; core_v0.19.0 works
# the same) (megatron/ and the GPT entry files, ~9 MB,
# unpatched: the smoke test patches a copy itself). Run it here, where the source is, then
# carry .smoke to the GPU machine (docs/cluster.md, "GPU smoke test").
#
#   scripts/gpu/prepare_smoke.sh [MEGATRON_LM_SOURCE]
#
# MEGATRON_LM_SOURCE: a Megatron-LM checkout at a supported tag, or a git repository (a clone or
# bare mirror) holding $MEGATRON_LM_TAG; default $MEGATRON_LM_DIR.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
src=${1:-${MEGATRON_LM_DIR:-}}
tag=${MEGATRON_LM_TAG:-core_v0.16.1}
[[ -n $src ]] || { echo "usage: $0 MEGATRON_LM_SOURCE (a checkout at a supported tag, or a git repo with tag $tag)" >&2; exit 2; }
dest=$repo/.smoke/Megatron-LM
files=(megatron pretrain_gpt.py gpt_builders.py model_provider.py LICENSE)

rm -rf "$dest"
mkdir -p "$dest"
if git -C "$src" rev-parse --verify -q "$tag" >/dev/null 2>&1 && [[ ! -f $src/pretrain_gpt.py || $(git -C "$src" rev-parse --is-bare-repository) == true ]]; then
    git -C "$src" archive --format=tar "$tag" "${files[@]}" | tar -x -C "$dest"
elif [[ -f $src/pretrain_gpt.py ]]; then
    (cd "$src" && tar -c --exclude=__pycache__ "${files[@]}") | tar -x -C "$dest"
else
    echo "error: $src is neither a Megatron-LM checkout nor a git repository with tag $tag" >&2
    exit 2
fi
if grep -q "megatron_bytescale.megatron import pretrain_hooks" "$dest/pretrain_gpt.py"; then
    echo "error: $src is already patched; give an unpatched checkout" >&2
    exit 2
fi
echo "prepared $dest ($(du -sh "$dest" | cut -f1)); carry .smoke to the GPU machine"
