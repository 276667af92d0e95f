"""Megatron-LM's own ``pretrain_gpt.py`` under HDP on this CPU machine (``bytescale demo --megatron-lm DIR``).

It starts

    python -m megatron_bytescale.torchrun --standalone --nproc-per-node N \\
        -m megatron_bytescale.launch DIR/pretrain_gpt.py

with the tiny model's flags (``configs/models/tiny.args``), the HDP flags and what a CPU run needs
(gloo comes from ``cpu_compat.install_training``; fp32, the local transformer implementation and
no TE/Apex fusions from the flags below): the same command line ``scripts/train_local.sh`` builds
with ``MODEL=tiny PRECISION=fp32 TRANSFORMER_IMPL=local``. Megatron's log lines go straight to the
terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..errors import ConfigError
from ..planner.specs import MODEL_DIR, read_args_file
from .rank_guard import DIE_WITH_PARENT

# what the local transformer implementation without TE/Apex refuses, and the torch.compile'd
# fusions (seconds of compiling on CPU for a model this small)
CPU_FLAGS = (
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
)


def pretrain_gpt_command(
    megatron_lm: str | Path,
    data: str,
    *,
    ranks: int,
    steps: int,
    capacity: int,
    context: int,
    step_tokens: int,
    seed: int,
    lr: float,
    profile: str | None = None,
) -> list[str]:
    script = Path(megatron_lm) / "pretrain_gpt.py"
    if not script.is_file():
        raise ConfigError(
            f"--megatron-lm {megatron_lm}: {script} not found; "
            "give a Megatron-LM checkout (core_v0.16.1 or core_v0.19.x)"
        )
    if step_tokens % context:
        raise ConfigError(
            f"--step-tokens {step_tokens} must be a multiple of --context {context} (Megatron's "
            "--global-batch-size is step tokens / sequence length)"
        )
    flags = [
        *read_args_file(MODEL_DIR / "tiny.args"),
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--seq-length",
        str(context),
        "--max-position-embeddings",
        str(context),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(step_tokens // context),
        "--train-iters",
        str(steps),
        "--lr",
        str(lr),
        "--min-lr",
        str(lr / 10),
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "1",
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "1.0",
        "--seed",
        str(seed + 1),
        "--use-distributed-optimizer",
        "--calculate-per-token-loss",
        "--attention-dropout",
        "0.0",
        "--transformer-impl",
        "local",
        *CPU_FLAGS,
        "--tokenizer-type",
        "NullTokenizer",
        "--log-interval",
        "1",
        "--data-path",
        data,
        "--eval-iters",
        "0",
        "--eval-interval",
        str(steps),
        "--hybrid-data-parallel",
        "--hdp-token-capacity",
        str(capacity),
        "--hdp-plan-ahead",
        "0",
    ]
    if profile:
        flags += ["--hdp-profile", str(profile)]
    # torchrun with the launch checks and one-line rank errors (megatron_bytescale/torchrun.py)
    return [
        sys.executable,
        "-m",
        "megatron_bytescale.torchrun",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "megatron_bytescale.launch",
        str(script),
        *flags,
    ]


def run_pretrain_gpt(megatron_lm: str | Path, data: str, **sizes) -> int:
    """Run it; returns torchrun's exit status."""
    command = pretrain_gpt_command(megatron_lm, data, **sizes)
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(megatron_lm).resolve()), str(root), os.environ.get("PYTHONPATH")])
        ),
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env[DIE_WITH_PARENT] = "1"  # the launcher, and so its ranks, end with this process
    print("Megatron-LM pretrain_gpt.py on CPU/gloo:\n  " + " ".join(command), flush=True)
    return subprocess.run(command, env=env, stdout=sys.stdout, stderr=sys.stderr).returncode
