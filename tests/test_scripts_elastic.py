"""Elastic launches (NNODES=MIN:MAX): scripts/train_local.sh and scripts/slurm/train_torchrun.sbatch
start torchrun's elastic agent (c10d rendezvous, --max-restarts) with --load on the run's own
--save folder, and refuse, in one line before torchrun starts, what an elastic run cannot do.
Stand-ins for srun / scontrol / torchrun as in test_scripts.py."""

import json

import pytest
from test_scripts import after, env, run_script  # noqa: F401 (env is a fixture)

ELASTIC = dict(
    NNODES="1:2", RDZV_ENDPOINT="127.0.0.1:29400", SAVE_DIR="/ckpt", GLOBAL_BATCH_SIZE="12", NPROC="2", MODEL="tiny"
)


def test_train_local_starts_the_elastic_agent_and_resumes_from_its_own_checkpoints(env):  # noqa: F811
    variables, mlm = env
    argv = json.loads(run_script("scripts/train_local.sh", dict(variables, **ELASTIC, RDZV_CONF="is_host=1")).stdout)[
        "argv"
    ]
    assert argv[:14] == [
        "torchrun",
        "--nnodes",
        "1:2",
        "--max-restarts",
        "3",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "--rdzv-id",
        "4242",
        "--rdzv-conf",
        "is_host=1",
        "--nproc-per-node",
    ]
    assert argv[14:16] == ["2", "-m"]
    assert after(argv, "--load")[0] == "/ckpt" and after(argv, "--save")[0] == "/ckpt"
    assert after(argv, "--global-batch-size")[0] == "12"


def test_torchrun_sbatch_elastic_keeps_the_step_when_a_node_dies(env, tmp_path):  # noqa: F811
    variables, _ = env
    srun = tmp_path / "bin" / "srun"  # record srun's own options too
    srun.write_text('#!/usr/bin/env bash\necho "srun $*" >&2\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    proc = run_script(
        "scripts/slurm/train_torchrun.sbatch",
        dict(variables, NNODES="1:2", SAVE_DIR="/ckpt", GLOBAL_BATCH_SIZE="16", MAX_RESTARTS="5"),
    )
    assert "--no-kill" in proc.stderr and "--kill-on-bad-exit=0" in proc.stderr
    argv = json.loads(proc.stdout)["argv"]
    assert argv[:12] == [
        "torchrun",
        "--nnodes",
        "1:2",
        "--max-restarts",
        "5",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"gpu-node-07:{20000 + 4242 % 20000}",
        "--rdzv-id",
        "4242",
        "--nproc-per-node",
    ]
    assert after(argv, "--load")[0] == "/ckpt"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(SAVE_DIR=""), "set SAVE_DIR"),
        (dict(GLOBAL_BATCH_SIZE=""), "set GLOBAL_BATCH_SIZE (divisible by every HDP size from 2 to 4)"),
        (dict(RDZV_ENDPOINT=""), "set RDZV_ENDPOINT=HOST:PORT"),
        (dict(NNODES="two"), "NNODES=two: give MIN:MAX nodes"),
        (dict(NNODES="3:2"), "the minimum 3 is above the maximum 2"),
        (dict(MAX_RESTARTS="-1"), "MAX_RESTARTS=-1"),
        (dict(NPROC="3", TP="2"), "world size 3 does not divide by TP=2"),  # per node: whole TP x PP groups
        (dict(LOAD_DIR="/other"), "an elastic run restarts from SAVE_DIR=/ckpt"),
    ],
    ids=lambda x: str(x) if isinstance(x, str) else ",".join(x),
)
def test_elastic_settings_are_refused_in_one_line(env, change, message):  # noqa: F811
    variables, _ = env
    proc = run_script("scripts/train_local.sh", {**variables, **ELASTIC, **change}, check=False)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
