"""Megatron-LM's pretrain_gpt.py under scripts/train_local.sh: a SIGKILLed launcher takes its
ranks with it and nothing is saved after the kill; a second run on the same --save folder is
refused with one line naming the first; the next run takes over the dead run's lock, saying so;
a checkpoint folder with a garbled tracker whose newest iteration has a flipped byte in a
.distcp shard resumes from the newest iteration that verifies, naming the one it skipped, and
continues the data stream its checkpoint recorded. Truncated and bit-flipped shards of a real
checkpoint are also checked one by one against its manifest, and its data-stream record against
changed settings.

One training run is started, killed and resumed (two Megatron starts, 2 gloo ranks, tiny model).
Needs MEGATRON_LM_DIR (a core_v0.16.1 checkout); skipped, with that reason, without it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_pretrain_gpt_cpu import _environment as pretrain_environment

from megatron_bytescale import checkpoint_manifest as manifest
from megatron_bytescale.megatron import checkpoint_guard
from megatron_bytescale.process_lifetime import _alive

from lifetime_support import wait_for
from megatron_lm import prepare_text_dataset

ROOT = Path(__file__).resolve().parent.parent
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_DIR or not (Path(MEGATRON_LM_DIR or ".") / "pretrain_gpt.py").is_file(),
    reason="set MEGATRON_LM_DIR to a Megatron-LM core_v0.16.1 checkout",
)
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")


def _environment(**variables) -> dict:
    """test_pretrain_gpt_cpu's settings (tiny model, fp32, local implementation) on 2 ranks."""
    return pretrain_environment(
        Path(MEGATRON_LM_DIR),
        NPROC=2,
        GLOBAL_BATCH_SIZE=4,
        PYTHON=sys.executable,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **variables,
    )


def _start(*flags, stdout=subprocess.PIPE, **variables) -> subprocess.Popen:
    return subprocess.Popen(
        [
            "bash",
            str(ROOT / "scripts/train_local.sh"),
            "--no-bias-swiglu-fusion",
            "--no-bias-dropout-fusion",
            "--ckpt-format",
            "torch_dist",
            *flags,
        ],
        env=_environment(**variables),
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _manifested(save: Path) -> list[int]:
    """The iterations in ``save`` with a manifest, newest first."""
    found = checkpoint_guard.saved_iterations(save)
    return [i for i in found if (checkpoint_guard.iteration_dir(save, i) / manifest.MANIFEST).exists()]


def _newest_files_mtime(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.rglob("*") if p.is_file()), default=0.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    files = sorted((ROOT / "megatron_bytescale").rglob("*.py"))
    return prepare_text_dataset(tmp_path_factory.mktemp("data") / "train", files)


@pytest.fixture(scope="module")
def killed_run(data, tmp_path_factory):
    """A long run saving every iteration, SIGKILLed once it has saved two checkpoints (with
    manifests); meanwhile a second run on the same folder was refused. Returns what was seen."""
    save = tmp_path_factory.mktemp("ckpt")
    # the log goes to a file: nothing reads a pipe while the run trains, and Megatron's argument
    # dump alone (core_v0.19: ~850 lines) would fill one and stall the run
    output = tmp_path_factory.mktemp("log") / "run.log"
    with open(output, "w") as log_file:
        run = _start(DATA_PATH=data, TRAIN_ITERS=10000, SAVE_DIR=save, SAVE_INTERVAL=1, stdout=log_file)
    try:
        wait_for(lambda: len(_manifested(save)) >= 2 or run.poll() is not None, 600, "two checkpoints with manifests")
        assert run.poll() is None, output.read_text()[-3000:]
        ranks = _children(run.pid)
        assert len(ranks) == 2, ranks
        t0 = time.monotonic()
        second = subprocess.run(
            ["bash", str(ROOT / "scripts/train_local.sh")],
            env=_environment(DATA_PATH=data, TRAIN_ITERS=5, SAVE_DIR=save),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        second_s = time.monotonic() - t0
        run.send_signal(signal.SIGKILL)
        killed_at = time.time()
        run.wait(timeout=30)
        t0 = time.monotonic()
        wait_for(lambda: not any(_alive(p) for p in ranks), 15, f"ranks {ranks} to end after the launcher's SIGKILL")
        ranks_gone_s = time.monotonic() - t0
        time.sleep(3)  # a rank still saving would write within this
        return dict(
            save=save,
            killed_at=killed_at,
            second=second,
            second_s=second_s,
            ranks=ranks,
            ranks_gone_s=ranks_gone_s,
            log=output.read_text(),
        )
    finally:
        if run.poll() is None:
            run.kill()


def test_sigkill_of_the_launcher_ends_every_rank_and_no_checkpoint_follows(killed_run):
    print(f"ranks {killed_run['ranks']} gone {killed_run['ranks_gone_s']:.2f} s after the launcher's SIGKILL")
    assert killed_run["ranks_gone_s"] < 10
    newest = _newest_files_mtime(killed_run["save"])
    assert newest <= killed_run["killed_at"] + 0.5, (
        f"a file was written {newest - killed_run['killed_at']:.1f} s after the kill"
    )


def test_a_second_run_on_the_same_save_folder_is_refused_naming_the_first(killed_run):
    second = killed_run["second"]
    lines = second.stderr.strip().splitlines()
    print(f"second run refused in {killed_run['second_s']:.2f} s: {lines}")
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
    assert re.match(
        rf"error: --save {re.escape(str(killed_run['save']))} is in use by another training run "
        r"\(job [^,]+, pid \d+ on \S+, heartbeat \d+ s ago\)",
        lines[0],
    ), lines


def test_truncated_and_bit_flipped_shards_fail_verification(killed_run, tmp_path):
    import shutil

    save = killed_run["save"]
    source = checkpoint_guard.iteration_dir(save, _manifested(save)[0])
    assert manifest.verify(source) is None
    for damage in ("truncate", "flip"):
        copy = tmp_path / damage
        shutil.copytree(source, copy)
        shard = sorted(copy.glob("*.distcp"))[1]
        data = bytearray(shard.read_bytes())
        if damage == "truncate":
            shard.write_bytes(data[: len(data) // 2])
            assert manifest.verify(copy) == (
                f"{shard.name} is truncated or overwritten: {len(data) // 2} of {len(data)} bytes"
            )
        else:
            data[len(data) // 2 : len(data) // 2 + 4096] = bytes(
                b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 4096]
            )
            shard.write_bytes(bytes(data))
            assert manifest.verify(copy) == f"{shard.name} does not match its checksum (corrupted)"


def test_resume_takes_over_the_dead_runs_lock_and_skips_a_corrupted_iteration(killed_run, data):
    save = killed_run["save"]
    newest, previous = _manifested(save)[:2]
    # a garbled tracker (Megatron would exit 0 having trained nothing): the newest iteration that
    # verifies is looked for among the folders
    (save / checkpoint_guard.TRACKER).write_text("abc")
    for later in checkpoint_guard.saved_iterations(save):
        if later > newest:
            subprocess.run(["rm", "-rf", str(checkpoint_guard.iteration_dir(save, later))], check=True)
    shard = sorted(checkpoint_guard.iteration_dir(save, newest).glob("*.distcp"))[0]
    raw = bytearray(shard.read_bytes())
    raw[1000:5096] = bytes(b ^ 0xFF for b in raw[1000:5096])  # 4 KB flipped, size unchanged
    shard.write_bytes(bytes(raw))
    t0 = time.monotonic()
    # the same schedule as the killed run (Megatron checks it on load), one iteration, then exit
    resumed = _start(
        "--exit-interval",
        str(previous + 1),
        DATA_PATH=data,
        TRAIN_ITERS=10000,
        SAVE_DIR=save,
        LOAD_DIR=save,
        SAVE_INTERVAL=1000,
    )
    log, _ = resumed.communicate(timeout=900)
    print(f"resumed in {time.monotonic() - t0:.1f} s")
    assert resumed.returncode == 0, log[-4000:]
    assert re.search(
        r"bytescale: took over the lock of --save .* from a dead run "
        r"\(job [^,]+, pid \d+ on \S+: its process is gone\)",
        log,
    ), log[-4000:]
    assert (
        f"bytescale: {save}/{checkpoint_guard.TRACKER} holds 'abc', not an iteration: resuming from the newest "
        "checkpoint that verifies"
    ) in log, log[-4000:]
    assert (
        f"bytescale: skipped checkpoint iter_{newest:07d} in {save}: {shard.name} does not match its checksum "
        "(corrupted)"
    ) in log, log[-4000:]
    assert "data-stream record" not in log  # continued from the recorded position, not replayed
    assert f"bytescale: checkpoint iter_{previous:07d} in {save} verified against its manifest" in log
    assert [int(i) for i in ITERATION.findall(log)] == [previous + 1], log[-3000:]


def test_each_checkpoint_records_its_data_stream_and_a_changed_one_is_refused(killed_run, data):
    from types import SimpleNamespace

    from megatron_bytescale.errors import ConfigError
    from megatron_bytescale.megatron import data_stream

    save = killed_run["save"]
    iteration = _manifested(save)[0]
    folder = checkpoint_guard.iteration_dir(save, iteration)
    body = data_stream.read(folder)
    assert data_stream.RECORD in manifest.read(folder)  # written before the manifest, covered by it
    assert body["iteration"] == iteration and set(body["position"]) == {"epoch", "index", "offset"}
    # the run's settings (tests/test_pretrain_gpt_cpu.py: 2 ranks, --global-batch-size 4, --seq-length 256)
    args = SimpleNamespace(
        hdp_step_tokens=4 * 256, seq_length=256, seed=1234, data_path=[data], train_data_path=None, load=str(save)
    )
    assert data_stream.resume_point(folder, args, iteration).line is None
    args.seed = 7
    with pytest.raises(ConfigError, match=r"was trained on another data stream \(--seed 1234 then, 7 now\)"):
        data_stream.resume_point(folder, args, iteration)


def test_a_refusal_only_the_ranks_can_make_is_one_line_from_the_launcher(data):
    """With --nproc-per-node auto the launcher does not know the world size, so the ranks validate:
    their refusal still ends in one line from the launcher (not one per rank plus torchrun's report)."""
    script = Path(MEGATRON_LM_DIR) / "pretrain_gpt.py"
    dry = subprocess.run(
        ["bash", str(ROOT / "scripts/train_local.sh"), "--micro-batch-size", "2"],
        env=_environment(DATA_PATH=data, TRAIN_ITERS=5, DRY_RUN=1),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    import shlex

    argv = shlex.split(dry.stdout.strip().splitlines()[-1])
    flags = argv[argv.index(str(script)) + 1 :]
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_bytescale.torchrun",
            "--standalone",
            "--nproc-per-node",
            "auto",
            "-m",
            "megatron_bytescale.launch",
            str(script),
            *flags,
        ],
        env=_environment(DATA_PATH=data),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    print(f"refused by the ranks in {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if re.match(r"error|Error|\S*Error", line)]
    assert errors == [
        "error: --hybrid-data-parallel packs each rank's micro-batch by tokens (--hdp-token-capacity), not by "
        "samples: use --micro-batch-size 1 (got 2)"
    ], errors
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "error_injection_rate" not in proc.stdout  # Megatron's argument dump is held back on a refusal
