"""Megatron-LM's own ``pretrain_gpt.py`` under HDP on this CPU machine (``bytescale demo --megatron-lm DIR``).

It starts

    python -m megatron_bytescale.torchrun --standalone --nproc-per-node N \\
        -m megatron_bytescale.launch DIR/pretrain_gpt.py

with the tiny model's flags (``configs/models/tiny.args``), the HDP flags and what a CPU run needs
(gloo comes from ``cpu_compat.install_training``; fp32, the local transformer implementation and
no TE/Apex fusions from the flags below): the same command line ``scripts/train_local.sh`` builds
with ``MODEL=tiny PRECISION=fp32 TRANSFORMER_IMPL=local``. Everything the ranks print goes to a
log file; the terminal gets the same lines without Megatron's argument dump (~700 lines), and a
closing summary read from the log: the loss of the first and last iteration, the mean iteration
time, the ranks per sequence and the P2P bytes of the HDP step lines.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from collections import Counter
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


ARGS_START = re.compile(r"^-+ arguments -+$")
ARGS_END = re.compile(r"^-+ end of arguments -+$")
ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+).*?lm loss: ([\d.Ee+-]+)"
)
HDP_LINE = re.compile(r"hdp iteration (\d+):.*?ranks/seq \[([^\]]*)\]; this rank sent ([\d.]+) MB P2P")


def run_pretrain_gpt(megatron_lm: str | Path, data: str, log: str | Path, **sizes) -> int:
    """Run it, every line into ``log`` and all but the argument dump onto the terminal, then the
    summary; returns torchrun's exit status."""
    command = pretrain_gpt_command(megatron_lm, data, **sizes)
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            filter(None, [str(Path(megatron_lm).resolve()), str(root), os.environ.get("PYTHONPATH")])
        ),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env[DIE_WITH_PARENT] = "1"  # the launcher, and so its ranks, end with this process
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    print("Megatron-LM pretrain_gpt.py on CPU/gloo:\n  " + " ".join(command), flush=True)
    print(f"every line the ranks print goes to {log}; Megatron's argument dump only there", flush=True)
    print(
        f"starting {sizes['ranks']} ranks: each imports torch and Megatron-LM before Megatron's first line ...",
        flush=True,
    )
    lines: list[str] = []
    in_dump = False
    with open(log, "w") as out:
        out.write(" ".join(command) + "\n")
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                lines.append(line)
                if ARGS_START.match(line.strip()):
                    in_dump = True
                if not in_dump:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                elif ARGS_END.match(line.strip()):
                    in_dump = False
        finally:
            code = proc.wait()
    if code == 0:
        print(summary(lines, log))
    return code


def summary(lines: list[str], log: Path) -> str:
    """The run in a few lines, from Megatron's iteration lines and the HDP step lines."""
    iterations = [(int(m[1]), float(m[2]), float(m[3])) for m in map(ITERATION.search, lines) if m]
    hdp = [m for m in map(HDP_LINE.search, lines) if m]
    if not iterations:
        return f"no iteration lines in {log}"
    times = [ms for _, ms, _ in iterations[1:]] or [iterations[0][1]]  # the first iteration warms up
    text = [
        "",
        f"Megatron-LM pretrain_gpt.py under HDP: {len(iterations)} iterations",
        f"  loss (lm loss)       : {iterations[0][2]:.4f} (iteration {iterations[0][0]}) -> {iterations[-1][2]:.4f} "
        f"(iteration {iterations[-1][0]})",
        f"  time per iteration   : {statistics.mean(times) / 1e3:.2f} s mean (iterations 2-{iterations[-1][0]})",
    ]
    if hdp:
        rings = Counter(m[2] for m in hdp)
        sent = statistics.median(float(m[3]) for m in hdp)
        text.append(
            "  ranks per sequence   : "
            + "; ".join(f"[{r}] in {n} of {len(hdp)} logged iterations" for r, n in rings.most_common(3))
        )
        text.append(f"  P2P sent by rank 0   : {sent:.1f} MB per iteration (median)")
    text.append(f"  log                  : {log}")
    return "\n".join(text)
