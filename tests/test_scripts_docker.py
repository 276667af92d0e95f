"""docker/Dockerfile, read (no Docker engine here): a pinned NGC PyTorch base, Megatron-LM at
core_v0.16.1 with every patch of the series applied in order, the plugin installed, and the GPU
stack (Transformer Engine, apex, flash-attn) checked."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
INSTRUCTIONS = {
    "FROM",
    "RUN",
    "CMD",
    "LABEL",
    "EXPOSE",
    "ENV",
    "ADD",
    "COPY",
    "ENTRYPOINT",
    "VOLUME",
    "USER",
    "WORKDIR",
    "ARG",
    "ONBUILD",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "SHELL",
}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = " ".join((pending + line).split())  # whitespace as the shell sees it
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((keyword, rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def args_defaults() -> dict[str, str]:
    return dict(
        re.fullmatch(r"(\w+)=(\S+)", rest).groups() for kw, rest in instructions() if kw == "ARG" and "=" in rest
    )


def runs() -> str:
    return "\n".join(rest for kw, rest in instructions() if kw == "RUN")


def test_every_line_is_a_docker_instruction():
    for keyword, _ in instructions():
        assert keyword in INSTRUCTIONS, keyword


def test_base_image_is_a_pinned_ngc_pytorch_release():
    froms = [rest for kw, rest in instructions() if kw == "FROM"]
    assert len(froms) == 1
    image = froms[0].replace("${NGC_PYTORCH_TAG}", args_defaults()["NGC_PYTORCH_TAG"])
    # the LTS base Megatron-LM core_v0.16.1 itself builds on (its docker/.ngc_version.lts)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", image), image
    assert image == "nvcr.io/nvidia/pytorch:25.09-py3"


def test_megatron_lm_is_cloned_at_the_patched_tag():
    defaults = args_defaults()
    assert defaults["MEGATRON_LM_TAG"] == "core_v0.16.1"
    assert defaults["MEGATRON_LM_REPO"].endswith("NVIDIA/Megatron-LM.git")
    assert re.search(
        r'git clone --depth 1 --branch "\$\{MEGATRON_LM_TAG\}" "\$\{MEGATRON_LM_REPO\}" "\$\{MEGATRON_LM_DIR\}"', runs()
    )


def test_the_patch_series_is_applied_in_order_and_checked():
    text = runs()
    copy = [rest for kw, rest in instructions() if kw == "COPY"]
    assert copy == [". ${BYTESCALE_DIR}"]  # patches/ travel with the source
    assert re.search(
        r'cd "\$\{MEGATRON_LM_DIR\}" && for p in "\$\{BYTESCALE_DIR\}"/patches/'
        r'"\$\{MEGATRON_LM_TAG%\.\*\}"/\*\.patch; do '
        r'git apply --check "\$p" && git apply "\$p" \|\| exit 1; done',
        text,
    )
    assert 'import pretrain_hooks" pretrain_gpt.py' in text  # and the result is verified


def test_the_plugin_and_megatron_training_are_importable():
    text = runs()
    assert re.search(r'pip install --no-cache-dir --no-deps -e "\$\{BYTESCALE_DIR\}"', text)
    envs = " ".join(rest for kw, rest in instructions() if kw == "ENV")
    assert "PYTHONPATH=${MEGATRON_LM_DIR}" in envs and "MEGATRON_LM_DIR=/opt/Megatron-LM" in envs
    assert "import megatron.training, megatron_bytescale.megatron.pretrain_hooks" in text
    # the image's own torch stays: nothing installs torch
    assert not re.search(r"pip install[^\n]*\btorch\b", text)


def test_the_gpu_stack_is_checked():
    text = runs()
    assert "import torch, transformer_engine.pytorch, apex" in text
    assert re.search(r'python -c "import flash_attn" .*\|\| .*pip install .*"flash-attn>=2\.6,<2\.9"', text)


def test_build_context_leaves_out_git_and_smoke_bundles():
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    for entry in (".git", ".smoke", "**/__pycache__"):
        assert entry in ignore
    assert "patches" not in ignore and "scripts" not in ignore


@pytest.mark.parametrize("flag", ["--gpus all", "--ipc=host"])
def test_usage_comment_shows_how_to_run(flag):
    assert flag in DOCKERFILE.read_text()
