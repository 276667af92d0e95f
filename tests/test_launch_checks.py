"""A wrong Megatron HDP launch ends in the launcher process, before any rank starts: one line,
exit status 2, and torch never imported (so it takes a second or two, not the 20 s and more of
starting ranks). Each case of the bad-input list: scripts/train_local.sh's own variables, then
flags Megatron's parser or the flag table or validate_hdp_args refuses, and entry scripts HDP
does not serve, through ``python -m megatron_bytescale.torchrun`` (what the script runs). The
launcher builds Megatron's parser of the tree from its spec (compared with the real parser in
tests/test_arguments_megatron.py): the tree here is the checkout's ``megatron`` package beside a
pretrain_gpt.py that would only say a rank started."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_bytescale.megatron import preflight

from megatron_lm import MEGATRON_LM_DIR, era, needs_tree

pytestmark = needs_tree

ROOT = Path(__file__).resolve().parent.parent

# sitecustomize for the launcher process: at exit, note whether torch was ever imported
PROBE = (
    "import atexit, os, sys\n"
    "atexit.register(lambda: open(os.environ['IMPORT_PROBE'], 'w').write(str('torch' in sys.modules)))\n"
)


@pytest.fixture
def launch(tmp_path):
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "megatron").symlink_to(Path(MEGATRON_LM_DIR) / "megatron")
    for script in ("pretrain_gpt.py", "pretrain_hybrid.py"):
        (mlm / script).write_text("raise SystemExit('a rank started')\n")
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"")
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    env = dict(
        os.environ,
        MEGATRON_LM_DIR=str(mlm),
        DATA_PATH=str(tmp_path / "corpus"),
        MODEL="tiny",
        NPROC="4",
        SEQ_LENGTH="256",
        HDP_TOKEN_CAPACITY="256",
        TRAIN_ITERS="10",
        LR_WARMUP_ITERS="1",
        PYTHON=sys.executable,
        IMPORT_PROBE=str(tmp_path / "torch_imported"),
        PYTHONPATH=os.pathsep.join([str(probe_dir), str(ROOT)]),
    )

    def run(*flags, command=None, **variables):
        t0 = time.monotonic()
        proc = subprocess.run(
            command or ["bash", str(ROOT / "scripts/train_local.sh"), *flags],
            env=dict(env, **{k: str(v) for k, v in variables.items()}),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        seconds = time.monotonic() - t0
        probe = tmp_path / "torch_imported"
        imported = probe.read_text() if probe.exists() else "not run"
        probe.unlink(missing_ok=True)
        return proc, seconds, imported

    return run, mlm, tmp_path


CASES = {
    "--context-parallel-size 2": (
        (("--context-parallel-size", "2"), {}),
        "error: --context-parallel-size 2 is a static CP mesh; HDP replaces it",
    ),
    "--micro-batch-size 2": (
        (("--micro-batch-size", "2"), {}),
        "error: --hybrid-data-parallel packs each rank's micro-batch "
        "by tokens (--hdp-token-capacity), not by samples: use --micro-batch-size 1 (got 2)",
    ),
    "sequence longer than ranks x capacity": (
        (("--seq-length", "2048", "--max-position-embeddings", "2048"), {}),
        "error: --seq-length 2K does not fit on 4 HDP ranks x --hdp-token-capacity 256 = 1K tokens",
    ),
    "--attention-dropout 0.1": (
        (("--attention-dropout", "0.1"), {}),
        "error: --attention-dropout 0.1: HDP ring attention",
    ),
    "--microbatch-group-size-per-virtual-pipeline-stage 3": (
        (
            (
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--microbatch-group-size-per-virtual-pipeline-stage",
                "3",
            ),
            {},
        ),
        "error: --microbatch-group-size-per-virtual-pipeline-stage 3: the HDP step picks each step's chunk order",
    ),
    "HDP_TOKEN_CAPACITY=0": (((), {"HDP_TOKEN_CAPACITY": "0"}), "error: HDP_TOKEN_CAPACITY=0: write tokens per rank"),
    "HDP_PLAN_AHEAD=-1": (
        ((), {"HDP_PLAN_AHEAD": "-1"}),
        "error: HDP_PLAN_AHEAD=-1: give how many steps to plan ahead",
    ),
    "TRAIN_ITERS <= LR_WARMUP_ITERS": (
        ((), {"TRAIN_ITERS": "5", "LR_WARMUP_ITERS": "5"}),
        "error: LR_WARMUP_ITERS=5 is not below TRAIN_ITERS=5",
    ),
    # the same refusals when the flags come after the script's own (the launcher checks them)
    "--hdp-token-capacity 0": ((("--hdp-token-capacity", "0"), {}), "error: argument --hdp-token-capacity: "),
    "--hdp-plan-ahead -1": (
        (("--hdp-plan-ahead", "-1"), {}),
        "error: argument --hdp-plan-ahead: must not be negative, got -1",
    ),
    "--lr-warmup-iters 10": (
        (("--lr-warmup-iters", "10"), {}),
        "error: --lr-warmup-iters 10 is not below --train-iters 10: the learning rate would never decay",
    ),
    # Megatron's own parser, before any rank: a misspelled flag with the nearest known one
    "misspelled --hdp-token-capcity": (
        (("--hdp-token-capcity", "256"), {}),
        "error: unrecognized arguments: --hdp-token-capcity 256 (did you mean --hdp-token-capacity?)",
    ),
    "misspelled Megatron flag": (
        (("--num-layer", "4"), {}),
        "error: unrecognized arguments: --num-layer 4 (did you mean --num-layers?)",
    ),
    "a value of the wrong type": ((("--num-layers", "four"), {}), "error: argument --num-layers: invalid int value"),
    # the flag table's refusals
    "--window-size 64,0": ((("--window-size", "64,0"), {}), "error: --window-size: HDP ring attention is full causal"),
    "--softmax-type learnable": (
        (("--softmax-type", "learnable"), {}),
        "error: --softmax-type learnable: HDP ring attention merges blocks with the plain softmax",
    ),
    "global_aux_loss": (
        (("--moe-router-load-balancing-type", "global_aux_loss"), {}),
        "error: --moe-router-load-balancing-type global_aux_loss: global_aux_loss and quantile_balancing",
    ),
    # the global batch: Megatron counts global-batch-size / data-parallel-size samples per rank
    "GLOBAL_BATCH_SIZE=6 on 4 ranks": (
        ((), {"GLOBAL_BATCH_SIZE": "6"}),
        "error: --global-batch-size 6 does not divide",
    ),
    # the scripts' variables
    "HDP_TOKEN_CAPCITY=1K": (
        ((), {"HDP_TOKEN_CAPCITY": "1K"}),
        "error: HDP_TOKEN_CAPCITY is not a variable of these scripts (a misspelling?)",
    ),
    "TP=two": (((), {"TP": "two"}), "error: TP=two: give a positive whole number"),
    "TRANSFORMER_IMPL=fast": (((), {"TRANSFORMER_IMPL": "fast"}), "error: TRANSFORMER_IMPL must be local or"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_wrong_launch_is_one_line_from_the_launcher_without_torch(launch, case):
    run, _, _ = launch
    (flags, variables), expected = CASES[case]
    proc, seconds, imported = run(*flags, **variables)
    print(f"{case}: {seconds:.2f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert imported in ("False", "not run"), "the launcher imported torch before refusing"


def test_step_batch_size_schedule_is_refused_by_the_parser_or_the_table(launch):
    """core_v0.16 has no such flag (Megatron's parser refuses it); core_v0.19 has, and the flag
    table refuses it (an HDP step plans one fixed batch)."""
    from megatron_bytescale.megatron_era import Era

    run, _, _ = launch
    proc, seconds, imported = run("--step-batch-size-schedule", "0:8")
    print(f"--step-batch-size-schedule: {seconds:.2f} s: {proc.stderr.strip()}")
    expected = (
        "error: unrecognized arguments: --step-batch-size-schedule 0:8"  # and no far-fetched suggestion
        if era() is Era.V016
        else "error: --step-batch-size-schedule 0:8 is not supported with --hybrid-data-parallel"
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and imported in ("False", "not run")
    assert len(lines) == 1 and lines[0].startswith(expected) and "did you mean" not in lines[0], lines


@pytest.mark.parametrize("script", ["pretrain_hybrid.py", "pretrain_mamba.py"])
def test_an_entry_script_hdp_does_not_serve_is_refused_by_name(launch, script):
    """The script's command line with pretrain_gpt.py swapped for another entry script of the
    checkout: refused by the launcher, before any rank (and by the rank-side launcher too)."""
    run, mlm, _ = launch
    (mlm / script).write_text("raise SystemExit('a rank started')\n")
    dry, _, _ = run(DRY_RUN="1", HDP_MODE="launcher")
    command = shlex.split(dry.stdout.strip().splitlines()[-1].replace("pretrain_gpt.py", script))
    proc, seconds, imported = run(command=command)
    print(f"{script}: {seconds:.2f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2 and imported == "False"
    assert proc.stderr.strip().splitlines() == [
        f"error: {script}: megatron_bytescale trains GPT models through Megatron-LM's pretrain_gpt.py; {script} "
        "(its own models, data and steps) is not supported under --hybrid-data-parallel: run pretrain_gpt.py"
    ]


def test_no_per_token_loss_through_the_launcher_module(launch):
    run, mlm, tmp_path = launch
    flags = [
        "--num-layers",
        "2",
        "--seq-length",
        "256",
        "--micro-batch-size",
        "1",
        "--attention-dropout",
        "0.0",
        "--data-path",
        str(tmp_path / "corpus"),
        "--hybrid-data-parallel",
        "--hdp-token-capacity",
        "256",
    ]
    command = [
        sys.executable,
        "-m",
        "megatron_bytescale.torchrun",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "megatron_bytescale.launch",
        str(mlm / "pretrain_gpt.py"),
        *flags,
    ]
    proc, seconds, imported = run(command=command)
    print(f"no --calculate-per-token-loss: {seconds:.2f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2 and imported == "False"
    assert proc.stderr.strip().splitlines() == [
        "error: --hybrid-data-parallel normalises the loss by the step's global token count (ranks hold different "
        "numbers of tokens and micro-batches): add --calculate-per-token-loss"
    ]


def test_the_save_folder_of_a_live_run_is_refused_before_the_ranks(launch):
    import json
    import socket

    from megatron_bytescale.folder_lock import SAVE_LOCK

    run, _, tmp_path = launch
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / SAVE_LOCK).write_text(
        json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": "", "started": 0})
    )
    proc, _, imported = run(SAVE_DIR=save)
    assert proc.returncode == 2 and imported == "False"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"error: --save {re.escape(str(save))} is in use by another training run \(pid {os.getpid()} on "
        rf"{re.escape(socket.gethostname())}, heartbeat \d+ s ago\); stop it, wait for it to finish, or choose another "
        r"--save \(a lock without heartbeat for 60 s is taken over\)",
        lines[0],
    ), lines


def test_the_launcher_finds_the_training_flags_and_the_world_size():
    from megatron_bytescale import torchrun

    argv = [
        "--nnodes",
        "1:2",
        "--nproc-per-node=4",
        "-m",
        "megatron_bytescale.launch",
        "/m/pretrain_gpt.py",
        "--seed",
        "3",
    ]
    own, flags = torchrun.split(argv)
    assert flags == ["--seed", "3"] and own == argv[:6] and torchrun.world_size(own) == 8
    assert torchrun.split(["--standalone", "/m/pretrain_gpt.py", "--x"])[1] == ["--x"]
    assert torchrun.world_size(["--nproc-per-node", "gpu"]) is None  # known to the ranks only: they check it
    args = preflight.parse(["--tensor-model-parallel-size", "2", "--hybrid-data-parallel"], MEGATRON_LM_DIR)
    args = preflight.derive(args, 8)
    assert args.data_parallel_size == 4 and args.hybrid_data_parallel and args.attention_dropout == 0.1
    assert preflight.training_command(["--standalone", "/m/pretrain_gpt.py", "--x"]) == ("/m/pretrain_gpt.py", ["--x"])


def test_a_tree_the_package_ships_no_spec_for_is_read_once_and_cached(tmp_path, monkeypatch):
    """A checkout whose argument sources match no shipped spec (here: none shipped): the
    launcher reads its real parser once in a subprocess, saying so, caches the spec by digest,
    and the next launch takes it from the cache. The spec is the one the package ships."""
    from megatron_bytescale.megatron import parser_spec

    shipped = parser_spec.find_shipped(Path(MEGATRON_LM_DIR))
    assert shipped is not None
    monkeypatch.setattr(parser_spec, "SPEC_DIR", tmp_path / "none-shipped")
    monkeypatch.setenv(parser_spec.CACHE_ENV, str(tmp_path / "cache"))
    said = []

    def announce(*words, **_):
        said.append(" ".join(map(str, words)))

    first = parser_spec.load(MEGATRON_LM_DIR, announce=announce)
    second = parser_spec.load(MEGATRON_LM_DIR, announce=announce)
    assert len(said) == 1 and "reading its parser once" in said[0], said
    assert first == second == shipped
    assert [p.name for p in (tmp_path / "cache" / "megatron_bytescale" / "parser-specs").iterdir()] == [
        f"{parser_spec.tree_version(Path(MEGATRON_LM_DIR))}-{shipped['digest'][:16]}.json"
    ]


# ------------------------------------------------------------------ what the ranks would have to find
def test_a_save_folder_that_cannot_be_written_is_refused_before_the_ranks(launch):
    run, _, tmp_path = launch
    (tmp_path / "a-file").write_text("not a folder")
    save = tmp_path / "a-file" / "ckpt"  # mkdir fails (ENOTDIR), as on a read-only or full filesystem
    proc, seconds, imported = run(SAVE_DIR=save)
    print(f"unwritable --save: {seconds:.2f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2 and imported == "False"
    assert proc.stderr.strip().splitlines() == [
        f"error: --save {save}: cannot write there (Not a directory); make it writable, free space, "
        "or choose another --save"
    ]


def test_a_save_folder_holding_checkpoints_is_not_overwritten_by_a_fresh_run(launch):
    run, _, tmp_path = launch
    save = tmp_path / "ckpt"
    (save / "iter_0000004").mkdir(parents=True)
    proc, _, imported = run(SAVE_DIR=save)
    assert proc.returncode == 2 and imported == "False"
    assert proc.stderr.strip().splitlines() == [
        f"error: --save {save} already holds checkpoints (newest iter_0000004) that this run would overwrite: it "
        f"starts from scratch (no --load); resume them with --load {save}, or choose an empty --save"
    ]
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000004"]  # the probe removed what it wrote


def test_a_resume_on_another_data_stream_is_refused_before_the_ranks(launch):
    import json

    from megatron_bytescale.megatron import data_stream

    run, _, tmp_path = launch
    load = tmp_path / "ckpt"
    (load / "iter_0000004").mkdir(parents=True)
    (load / "latest_checkpointed_iteration.txt").write_text("4")
    saved = {  # what a run with these settings writes (tests/test_megatron_reliability.py reads a real one)
        "step_tokens": 4 * 256,  # --global-batch-size (4 ranks) x --seq-length
        "seq_length": 256,
        "seed": 1234,
        "dataset": [data_stream.dataset_identity(tmp_path / "corpus")],
        "blend": None,
        "split": [[0.0, 0.969]],  # Megatron's default --split 969,30,1
    }
    record = {"version": 1, "iteration": 4, "fields": saved, "position": {"epoch": 0, "index": 3, "offset": 0}}
    (load / "iter_0000004" / data_stream.RECORD).write_text(json.dumps(record))
    proc, seconds, imported = run("--seed", "7", "--hdp-step-tokens", "2K", LOAD_DIR=load)
    print(f"another data stream: {seconds:.2f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2 and imported == "False"
    assert proc.stderr.strip().splitlines() == [
        f"error: --load {load}: iteration 4 was trained on another data stream (--hdp-step-tokens 1024 then, 2048 "
        "now; --seed 1234 then, 7 now): resume with the settings it was saved with, or pass "
        "--hdp-accept-data-change to continue on the new stream deliberately"
    ]


# ------------------------------------------------------------------ the launcher's own end
def test_the_rank_that_failed_first_is_named_with_why(tmp_path):
    import json
    import signal
    from types import SimpleNamespace

    from megatron_bytescale.torchrun import first_failure

    def failure(pid, exitcode):
        return SimpleNamespace(pid=pid, exitcode=exitcode)

    # rank 1 SIGKILLed: rank 0 failed on its lost peer (or torchrun stopped it); rank 1 is named
    killed = {0: failure(100, 1), 1: failure(101, -signal.SIGKILL), 2: failure(102, -signal.SIGTERM)}
    assert first_failure(killed, str(tmp_path)) == (
        1,
        "rank 1 (pid 101) was killed by SIGKILL first (2 other rank(s) stopped after it)",
    )
    # two uncaught exceptions: the earlier one is named, with its last line
    for rank, when, why in ((0, 2.0, "RuntimeError: Connection closed by peer"), (3, 1.0, "ValueError: bad batch")):
        (tmp_path / f"uncaught{rank}").write_text(json.dumps({"message": why, "status": 1, "time": when}))
    raised = {0: failure(100, 1), 3: failure(103, 1), 1: failure(101, -signal.SIGTERM)}
    assert first_failure(raised, str(tmp_path)) == (
        1,
        "rank 3 (pid 103) failed first: ValueError: bad batch; its traceback is above (2 other rank(s) stopped "
        "after it)",
    )
    # a rank's own one-line report wins, with its status
    (tmp_path / "rank2").write_text(json.dumps({"message": "--thing 7 is wrong", "status": 2, "time": 5.0}))
    assert first_failure(raised, str(tmp_path)) == (2, "--thing 7 is wrong")


def test_an_uncaught_exception_is_noted_for_the_launcher_unless_a_peer_reported_the_cause(tmp_path):
    import json

    script = (
        "from megatron_bytescale.megatron import rank_guard\n"
        "rank_guard.record_uncaught()\n"
        "raise RuntimeError('Connection closed by peer')\n"
    )
    env = dict(os.environ, BYTESCALE_RANK_ERRORS=str(tmp_path), RANK="1", PYTHONPATH=str(ROOT))
    alone = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert alone.returncode == 1 and alone.stderr.strip().endswith("RuntimeError: Connection closed by peer")
    noted = json.loads((tmp_path / "uncaught1").read_text())
    assert noted["message"] == "RuntimeError: Connection closed by peer" and noted["status"] == 1
    (tmp_path / "uncaught1").unlink()
    (tmp_path / "rank0").write_text(json.dumps({"message": "the planning process ...", "status": 1, "time": 1.0}))
    after = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert after.returncode == 1 and after.stderr == ""  # the launcher prints rank 0's line; nothing to add
    assert not (tmp_path / "uncaught1").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_ends_in_one_line_and_128_plus_its_number(tmp_path, sig):
    import signal

    from lifetime_support import wait_for

    script = tmp_path / "sleeper.py"
    script.write_text(  # a rank as the hooks make one (die with the launcher, end quietly on its SIGINT)
        "import os, sys, time\n"
        "from megatron_bytescale.megatron import rank_guard\n"
        "rank_guard.die_with_launcher()\n"
        "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_bytescale.torchrun", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path)],
        env=dict(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_for(lambda: all((tmp_path / r).exists() for r in "01"), 120, "two ranks")
        time.sleep(0.5)  # their pid files are written
        pids = [int((tmp_path / r).read_text()) for r in "01"]
        number = getattr(signal, sig)
        proc.send_signal(number)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"{sig}: exit {proc.returncode}: {err.strip()!r}")
    assert proc.returncode == 128 + number
    assert err.strip().splitlines() == ["interrupted"]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
