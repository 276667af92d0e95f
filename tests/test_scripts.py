"""Launch scripts (scripts/*.sh, scripts/slurm/*, scripts/gpu/smoke_pretrain_gpt.sh).

Syntax (bash -n) and shellcheck (when installed; skipped otherwise) for every script, then
behaviour with DRY_RUN=1 and stand-ins for srun / scontrol / torchrun on PATH: the command
lines they build, the rank environment they export, and (with MEGATRON_LM_DIR set) that
Megatron-LM's real parser and validate_args plus validate_hdp_args accept those command lines.
"""

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lm import MEGATRON_LM_DIR, needs_tree

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(
    [*ROOT.glob("scripts/*.sh"), *ROOT.glob("scripts/slurm/*"), *ROOT.glob("scripts/gpu/*.sh")],
    key=str,
)


def test_the_scripts_are_there():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {
        "scripts/hdp_env.sh",
        "scripts/train_local.sh",
        "scripts/slurm/srun_rank_env.sh",
        "scripts/slurm/train_srun.sbatch",
        "scripts/slurm/train_torchrun.sbatch",
        "scripts/gpu/smoke_pretrain_gpt.sh",
    } <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_bash_syntax(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)"
)
def test_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "path", [p for p in SCRIPTS if p.name not in ("hdp_env.sh", "elastic_env.sh", "gpu_env.sh")], ids=lambda p: p.name
)
def test_runnable_scripts_are_executable(path):
    assert path.stat().st_mode & stat.S_IXUSR


# ---------------------------------------------------------------- stand-ins
def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def env(tmp_path):
    """A fake Megatron-LM checkout, a PATH with stand-in scontrol/srun/torchrun/python, and
    the variables a user sets."""
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("# unpatched\n")
    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):  # the scripts check that the dataset is there
        (data / f"corpus{suffix}").write_bytes(b"")
    (tmp_path / "p.json").write_text("{}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "scontrol", 'echo "gpu-node-07"; echo "gpu-node-08"\n')
    # srun: drop its own options, run the command once as node 1 / task 9 of a 2x8 job
    _tool(
        bin_dir,
        "srun",
        "while [[ $1 == --* ]]; do shift; done\n"
        'SLURM_NODEID=1 SLURM_PROCID=9 SLURM_LOCALID=1 SLURM_NTASKS=16 exec "$@"\n',
    )
    record = (
        'import json, os, sys; print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in '
        '("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}}))'
    )
    _tool(bin_dir, "torchrun", f"exec {sys.executable} -c '{record}' torchrun \"$@\"\n")
    # python: `-m megatron_bytescale.torchrun ...` is recorded as torchrun (what it runs in-process);
    # the launch check (`-m megatron_bytescale.megatron.preflight`) leaves its argv in preflight.json
    _tool(
        bin_dir,
        "python",
        f"if [[ $1 == -m && $2 == megatron_bytescale.torchrun ]]; then shift 2; "
        f"exec {sys.executable} -c '{record}' torchrun \"$@\"; fi\n"
        f"if [[ $1 == -m && $2 == megatron_bytescale.megatron.preflight ]]; then shift 2; "
        f"exec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "
        f'"$@" >{tmp_path}/preflight.json; fi\n'
        f"exec {sys.executable} -c '{record}' python \"$@\"\n",
    )
    variables = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        MEGATRON_LM_DIR=str(mlm),
        DATA_PATH=str(data / "corpus"),
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="gpu-node-[07-08]",
        SLURM_JOB_ID="4242",
        SLURM_NTASKS_PER_NODE="8",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    for name in ("MASTER_ADDR", "MASTER_PORT", "DRY_RUN", "MODEL", "TP", "PP", "HDP_MODE", "VALID_DATA_PATH"):
        variables.pop(name, None)
    return variables, mlm


def run_script(script, variables, *args, check=True):
    proc = subprocess.run(
        ["bash", str(ROOT / script), *args], env=variables, capture_output=True, text=True, timeout=60
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def model_args(name):
    from megatron_bytescale.planner.specs import MODEL_DIR, read_args_file

    return read_args_file(MODEL_DIR / f"{name}.args")


def after(argv, marker):
    return argv[argv.index(marker) + 1 :]


def test_train_local_runs_torchrun_with_the_launcher(env):
    variables, mlm = env
    out = json.loads(
        run_script("scripts/train_local.sh", dict(variables, NPROC="4", MODEL="tiny"), "--seed", "7").stdout
    )
    argv = out["argv"]
    assert argv[:5] == ["torchrun", "--standalone", "--nproc-per-node", "4", "-m"]
    assert argv[5:7] == ["megatron_bytescale.launch", str(mlm / "pretrain_gpt.py")]
    flags = argv[7:]
    assert flags[: len(model_args("tiny"))] == model_args("tiny")
    for pair in (
        ["--hybrid-data-parallel", "--hdp-token-capacity"],
        ["--global-batch-size", "4"],
        ["--data-path", variables["DATA_PATH"], "--eval-iters", "0"],
        ["--seed", "7"],
    ):
        i = flags.index(pair[0])
        assert flags[i : i + len(pair)] == pair
    assert "--calculate-per-token-loss" in flags and flags[-2:] == ["--seed", "7"]


def test_a_patched_checkout_runs_pretrain_gpt_itself(env):
    variables, mlm = env
    (mlm / "pretrain_gpt.py").write_text("from megatron_bytescale.megatron import pretrain_hooks as hdp\n")
    argv = json.loads(run_script("scripts/train_local.sh", dict(variables, NPROC="2")).stdout)["argv"]
    assert argv[3:5] == ["2", str(mlm / "pretrain_gpt.py")]
    assert "-m" not in argv
    # HDP_MODE forces the launcher even then
    argv = json.loads(run_script("scripts/train_local.sh", dict(variables, NPROC="2", HDP_MODE="launcher")).stdout)[
        "argv"
    ]
    assert argv[4:6] == ["-m", "megatron_bytescale.launch"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (dict(MODEL="gpt-9"), "unknown model 'gpt-9'"),
        (dict(DATA_PATH=""), "set DATA_PATH"),
        (dict(MEGATRON_LM_DIR="/nonexistent"), "pretrain_gpt.py not found"),
        (dict(TP="3", NPROC="8"), "does not divide by TP=3"),
        (dict(TP="2", PP="3", NPROC="8"), "world size 8 does not divide by TP=2 x PP=3"),
        (dict(PP="two"), "PP=two: give the number of pipeline stages"),
        (dict(HDP_MODE="fast"), "HDP_MODE must be auto, patched or launcher"),
        (dict(DATA_PATH="/nonexistent/corpus"), "/nonexistent/corpus.bin and .idx not found"),
        (dict(DATA_PATH="/data/corpus.bin"), "without .bin/.idx (DATA_PATH=/data/corpus)"),
        (dict(NPROC="0"), "NPROC=0: give the number of ranks"),
        (dict(HDP_TOKEN_CAPACITY="8Q"), "HDP_TOKEN_CAPACITY=8Q: write tokens"),
        (dict(HDP_TOKEN_CAPACITY="0"), "HDP_TOKEN_CAPACITY=0: write tokens per rank and micro-batch (more than 0)"),
        (dict(HDP_PLAN_AHEAD="-1"), "HDP_PLAN_AHEAD=-1: give how many steps to plan ahead"),
        (dict(TRAIN_ITERS="100", LR_WARMUP_ITERS="100"), "LR_WARMUP_ITERS=100 is not below TRAIN_ITERS=100"),
        (dict(HDP_SELECTIVE_OFFLOAD="yes"), "HDP_SELECTIVE_OFFLOAD must be 0 or 1, got 'yes'"),
        (dict(HDP_PROFILE="/missing.json"), "HDP_PROFILE=/missing.json: no such file"),
    ],
)
def test_train_local_refuses_bad_settings(env, extra, message):
    variables, _ = env
    proc = run_script("scripts/train_local.sh", dict(variables, **extra), check=False)
    assert proc.returncode == 2 and message in proc.stderr


def test_optional_variables_become_flags(env):
    variables, _ = env
    settings = dict(
        VALID_DATA_PATH="/data/valid",
        HDP_STEP_TOKENS="2M",
        HDP_BALANCE="none",
        HDP_SELECTIVE_OFFLOAD="1",
        HDP_PROFILE=str(Path(variables["DATA_PATH"]).parent.parent / "p.json"),
        HDP_DATALOADER="ray",
        HDP_RAY_ADDRESS="head:6379",
        SAVE_DIR="/ckpt",
        LOAD_DIR="/ckpt",
        TP="2",
        NPROC="8",
    )
    flags = json.loads(run_script("scripts/train_local.sh", dict(variables, **settings)).stdout)["argv"]
    text = " ".join(flags)
    for expected in (
        f"--train-data-path {variables['DATA_PATH']} --valid-data-path /data/valid --eval-iters 10",
        "--hdp-step-tokens 2M",
        "--hdp-balance none",
        "--hdp-selective-offload",
        f"--hdp-profile {Path(variables['DATA_PATH']).parent.parent / 'p.json'}",
        "--hdp-dataloader ray",
        "--hdp-ray-address head:6379",
        "--save /ckpt",
        "--load /ckpt",
        "--tensor-model-parallel-size 2",
        "--global-batch-size 4",
    ):
        assert expected in text, expected
    assert "--hdp-hardware" not in flags  # the profile replaces it


def test_pipeline_stages_divide_the_world_with_tp(env):
    variables, _ = env
    argv = json.loads(run_script("scripts/train_local.sh", dict(variables, TP="2", PP="2", NPROC="8")).stdout)["argv"]
    assert (
        after(argv, "--pipeline-model-parallel-size")[0] == "2"
        and after(argv, "--tensor-model-parallel-size")[0] == "2"
    )
    assert after(argv, "--global-batch-size")[0] == "2"  # 8 ranks / (TP 2 x PP 2) HDP ranks


def test_dry_run_prints_one_shell_line(env):
    variables, mlm = env
    out = run_script("scripts/train_local.sh", dict(variables, DRY_RUN="1", NPROC="2")).stdout.strip()
    argv = shlex.split(out)
    assert argv[:3] == ["python", "-m", "megatron_bytescale.torchrun"] and str(mlm / "pretrain_gpt.py") in argv


def test_srun_sbatch_starts_every_rank_with_its_environment(env):
    variables, mlm = env
    out = json.loads(run_script("scripts/slurm/train_srun.sbatch", variables).stdout)
    assert out["env"] == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu-node-07",
        "MASTER_PORT": str(20000 + 4242 % 20000),
        "PYTHONPATH": out["env"]["PYTHONPATH"],
    }
    assert out["env"]["PYTHONPATH"].split(os.pathsep)[:2] == [str(mlm), str(ROOT)]
    argv = out["argv"]
    assert argv[:4] == ["python", "-m", "megatron_bytescale.launch", str(mlm / "pretrain_gpt.py")]
    assert after(argv, "--global-batch-size")[0] == "16"  # 2 nodes x 8 ranks, TP 1
    # the launch check ran first, on the whole world and the same command line
    checked = json.loads((Path(variables["DATA_PATH"]).parent.parent / "preflight.json").read_text())
    assert checked[:2] == ["--world-size", "16"] and checked[2:] == argv[1:]


def test_torchrun_sbatch_starts_one_torchrun_per_node(env):
    variables, mlm = env
    out = json.loads(run_script("scripts/slurm/train_torchrun.sbatch", dict(variables, GPUS_PER_NODE="4")).stdout)
    argv = out["argv"]
    assert argv[:11] == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--node-rank",
        "1",
        "--rdzv-id",
        "4242",
        "--rdzv-backend",
        "c10d",
    ]
    assert argv[11:13] == ["--rdzv-endpoint", f"gpu-node-07:{20000 + 4242 % 20000}"]
    assert argv[13:16] == ["-m", "megatron_bytescale.launch", str(mlm / "pretrain_gpt.py")]
    assert after(argv, "--global-batch-size")[0] == "8"


def test_srun_rank_env_reads_the_compact_tasks_per_node_form(env):
    variables, _ = env
    variables = dict(variables, SLURM_PROCID="3", SLURM_NTASKS="8", SLURM_LOCALID="3", SLURM_TASKS_PER_NODE="4(x2)")
    variables.pop("SLURM_NTASKS_PER_NODE")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/srun_rank_env.sh"), "python"],
        env=variables,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)["env"]
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"], got["LOCAL_WORLD_SIZE"], got["MASTER_ADDR"]) == (
        "3",
        "8",
        "3",
        "4",
        "gpu-node-07",
    )
    # outside srun it refuses
    variables.pop("SLURM_PROCID")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/srun_rank_env.sh"), "true"],
        env=variables,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "run this under srun" in proc.stderr


# ---------------------------------------------------------------- against Megatron-LM
@needs_tree
@pytest.mark.parametrize("model", ["tiny", "llama-7b"])
def test_script_command_lines_pass_megatron_and_hdp_validation(env, model):
    variables, _ = env
    variables = dict(
        variables,
        MEGATRON_LM_DIR=MEGATRON_LM_DIR,
        MODEL=model,
        NPROC="8",
        TRANSFORMER_IMPL="local",
        VALID_DATA_PATH="/data/valid",
    )
    argv = json.loads(run_script("scripts/train_local.sh", variables).stdout)["argv"]
    flags = argv[argv.index(str(Path(MEGATRON_LM_DIR) / "pretrain_gpt.py")) + 1 :]
    from test_arguments_megatron import run

    out = run(
        f"""
args = megatron_parser().parse_args({flags!r})
args.rank, args.world_size = 0, 8
validate_args(args, {{}})
validate_hdp_args(args)
print(json.dumps({{"hdp_size": args.hdp_size, "capacity": args.hdp_token_capacity, "step": args.hdp_step_tokens}}))
"""
    )
    assert out == {"hdp_size": 8, "capacity": 8192, "step": 8 * 32768}


# ---------------------------------------------------------------- GPU smoke script
def test_smoke_dry_run_prints_the_patched_and_the_launcher_run(env):
    variables, mlm = env
    lines = run_script("scripts/gpu/smoke_pretrain_gpt.sh", dict(variables, DRY_RUN="1")).stdout.strip().splitlines()
    patched, launcher = (shlex.split(line) for line in lines)
    assert patched[:6] == ["python", "-m", "megatron_bytescale.torchrun", "--standalone", "--nproc-per-node", "1"]
    assert patched[6] == str(mlm / "pretrain_gpt.py") and launcher[6:9] == [
        "-m",
        "megatron_bytescale.launch",
        str(mlm / "pretrain_gpt.py"),
    ]
    assert after(patched, "--train-iters")[0] == "4" and after(launcher, "--train-iters")[0] == "6"
    assert "--load" not in patched and after(launcher, "--load")[0] == after(patched, "--save")[0]
    assert after(patched, "--transformer-impl")[0] == "local"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is present: run the smoke test itself")
def test_smoke_refuses_to_run_without_a_gpu(env):
    variables, _ = env
    variables = dict(variables, PYTHON=sys.executable)
    proc = run_script("scripts/gpu/smoke_pretrain_gpt.sh", variables, check=False)
    assert proc.returncode != 0 and "this smoke test needs a GPU" in proc.stderr


@needs_tree
def test_smoke_command_lines_pass_megatron_and_hdp_validation(env, tmp_path):
    variables, _ = env
    lines = run_script(
        "scripts/gpu/smoke_pretrain_gpt.sh", dict(variables, DRY_RUN="1", MEGATRON_LM_DIR=MEGATRON_LM_DIR)
    ).stdout
    from test_arguments_megatron import run

    for line in lines.strip().splitlines():
        argv = shlex.split(line)
        script = (Path(MEGATRON_LM_DIR) / "pretrain_gpt.py").resolve()
        at = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py") and Path(a).resolve() == script)
        flags = argv[at + 1 :]
        out = run(
            f"""
args = megatron_parser().parse_args({flags!r})
args.rank, args.world_size = 0, 1
validate_args(args, {{}})
validate_hdp_args(args)
print(json.dumps({{"hdp_size": args.hdp_size, "step": args.hdp_step_tokens, "impl": args.transformer_impl}}))
"""
        )
        assert out == {"hdp_size": 1, "step": 8192, "impl": "local"}


@needs_tree
def test_the_flex_check_runs_the_same_command_with_each_dispatcher(env, tmp_path):
    """scripts/gpu/check_flex_dispatcher.sh (prepared: it needs 2 GPUs and DeepEP) trains the
    same command line with the all-to-all and the flex dispatcher; through the launcher's
    checks on this CPU machine the first passes and the second is refused in one line."""
    from megatron_bytescale.errors import ConfigError
    from megatron_bytescale.megatron import preflight

    variables, _ = env
    corpus = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"")
    lines = run_script(
        "scripts/gpu/check_flex_dispatcher.sh", dict(variables, DRY_RUN="1", MEGATRON_LM_DIR=MEGATRON_LM_DIR)
    ).stdout.strip()
    alltoall, flex = (shlex.split(line) for line in lines.splitlines())
    assert after(alltoall, "--moe-token-dispatcher-type")[0] == "alltoall"
    assert (
        after(flex, "--moe-token-dispatcher-type")[0] == "flex"
        and after(flex, "--expert-model-parallel-size")[0] == "2"
    )
    script = Path(MEGATRON_LM_DIR) / "pretrain_gpt.py"

    def flags(argv):
        words = argv[argv.index(str(script)) + 1 :]
        return [str(corpus) if w.endswith("/corpus") else w for w in words]

    assert preflight.check(flags(alltoall), 2, script).moe_token_dispatcher_type == "alltoall"
    with pytest.raises(ConfigError, match=r"^--moe-token-dispatcher-type flex \(deepep\) runs CUDA kernels"):
        preflight.check(flags(flex), 2, script)
