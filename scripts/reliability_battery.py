"""The operator's battery: checkpoints, resumes, the planning process and the launcher under
faults, each case through ``scripts/train_local.sh`` (the tiny model on 1-2 gloo ranks, fp32).

    python scripts/reliability_battery.py --megatron-lm /path/to/Megatron-LM [--cases a,b] [--json OUT]

Each case prints its command, the lines of its output that tell what happened (errors,
``bytescale:`` lines, tracebacks' last lines, the iterations trained), its exit code and wall
time, the processes it left behind, and whether the promise holds (``holds``/``FAILS``, with
why). ``--repo`` runs another checkout's ``train_local.sh`` (e.g. an older commit, to see a case
fail); ``--list`` names the cases. Cases that need a tmpfs (a read-only or full ``--save``)
mount one in a private mount namespace (``unshare``); where that is refused they say so. A case
takes 1-3 minutes on 2 loaded cores; the whole battery about 40. The cheap cases are also tests
(tests/test_resume_reliability.py, tests/test_launch_checks.py); this script is the rest and the
record the documents quote (docs/cluster.md, "Reliability").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torchrun's prefix of a rank's traceback lines
KEY = re.compile(
    r"^error|: error:|^bytescale|^elastic|interrupted|Traceback|^\S*(Error|Exception)\b|^\s*raise |"
    r"WARNING: could not find|will not load|start from random|Invalid metadata|exited with code|planning process|"
    r"no space|Read-only|"
    r"timed out|Timeout|[Kk]illed"
)
# the fixed part of every run: scripts/train_local.sh's CPU settings (docs/cluster.md, CPU (gloo))
ENVIRONMENT = dict(
    MODEL="tiny",
    PRECISION="fp32",
    TRANSFORMER_IMPL="local",
    SEQ_LENGTH="256",
    HDP_TOKEN_CAPACITY="256",
    LR_WARMUP_ITERS="0",
    LOG_INTERVAL="1",
    LR="1e-3",
    NPROC="2",
    GLOBAL_BATCH_SIZE="4",
    TRAIN_ITERS="100",
    OMP_NUM_THREADS="1",
    PYTHONDONTWRITEBYTECODE="1",
)
FLAGS = ("--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--ckpt-format", "torch_dist")


@dataclass
class Outcome:
    case: str
    what: str
    command: str = ""
    rc: int | None = None
    seconds: float = 0.0
    iterations: list[int] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    left_behind: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    holds: bool = False
    why: str = ""

    def text(self) -> str:
        out = [f"== {self.case}: {self.what}", f"$ {self.command}"]
        out += [f"  | {line}" for line in self.lines]
        if self.iterations:
            out.append(f"  iterations trained: {' '.join(map(str, self.iterations))}")
        out += [f"  {fact}" for fact in self.facts]
        if self.left_behind:
            out.append(f"  left behind: {'; '.join(self.left_behind)}")
        out.append(f"  exit {self.rc} in {self.seconds:.1f} s: {'holds' if self.holds else 'FAILS'} ({self.why})")
        return "\n".join(out)


# ------------------------------------------------------------------ processes
def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))):
            parents[int(entry.name)] = st[0]
    out, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        out += kids
        frontier += kids
    return out


def _started(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot): tells a process from a later one given its PID."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


class Run:
    """One ``train_local.sh`` run in a session of its own, its output in a log file; every
    process it started is remembered, so what outlives it can be named and then ended."""

    def __init__(self, work: Path, repo: Path, common: dict, env: dict, flags: list[str], name: str):
        self.log_path = work / f"{name}.log"
        self.env, self.flags = env, flags
        argv = ["bash", str(repo / "scripts/train_local.sh"), *FLAGS, *flags]
        shown = {k: v for k, v in env.items() if k not in common or common[k] != v}
        self.command = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(shown.items())) + " " + shlex.join(argv)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed by finish()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=repo, start_new_session=True
        )
        self.seen: dict[int, tuple[str | None, str]] = {}  # pid -> (start time, command line)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._track, daemon=True)
        self._watch.start()

    def _track(self) -> None:
        while not self._stop.is_set():
            for pid in descendants(self.proc.pid):
                if pid not in self.seen:
                    self.seen[pid] = (_started(pid), _cmdline(pid)[:200])
            self._stop.wait(0.3)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.proc.poll() is None:
            if predicate(self.log()):
                return True
            time.sleep(0.2)
        return predicate(self.log())

    def ranks(self) -> list[int]:
        """The pretrain_gpt.py ranks: the launcher's children (train_local.sh execs the launcher,
        whose torchrun agent starts them), in rank order."""
        kids = [p for p in descendants(self.proc.pid) if (_stat(p) or (0,))[0] == self.proc.pid]
        ranks = [p for p in kids if "pretrain_gpt.py" in _cmdline(p)]
        return sorted(ranks, key=lambda p: _environ(p).get("RANK", "?"))

    def finish(self, timeout_s: float) -> tuple[int | None, float, list[str]]:
        """Wait for the launcher (SIGKILL to its session after ``timeout_s``); then name and end
        what it left behind."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        seconds = time.monotonic() - self.t0
        time.sleep(2)  # what dies with its parent dies within this
        self._stop.set()
        self._watch.join()
        self._log.close()
        left = []
        for pid, (started, cmd) in sorted(self.seen.items()):
            if alive(pid) and _started(pid) == started:  # the same process, not a later one given its PID
                st = _stat(pid)
                left.append(f"pid {pid} (parent {st[0] if st else '?'}, state {st[1] if st else '?'}): {cmd[:200]}")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return rc, seconds, left


def _environ(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def summary(log: str, limit: int = 14) -> tuple[list[int], list[str]]:
    """(iterations trained, the key lines deduplicated with counts)."""
    iterations = [int(i) for i in ITERATION.findall(log)]
    counts: dict[str, int] = {}
    for line in log.splitlines():
        line = RANK_PREFIX.sub("", line.strip())
        if not line or ITERATION.search(line) or re.match(r"^\w[\w ]* \.{3,}", line):  # Megatron's argument dump
            continue
        if KEY.search(line):
            line = re.sub(r"\s+", " ", line)[:300]
            counts[line] = counts.get(line, 0) + 1
    lines = [line if n == 1 else f"{line}  (x{n})" for line, n in counts.items()]
    if len(lines) > limit:
        lines = lines[: limit // 2] + [f"... {len(lines) - limit} more ..."] + lines[-limit // 2 :]
    return iterations, lines


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ the battery
class Battery:
    def __init__(self, repo: Path, python: str, megatron_lm: Path, work: Path):
        self.repo, self.work, self.megatron_lm = repo, work, megatron_lm
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
        self.base_env.update(
            ENVIRONMENT,
            MEGATRON_LM_DIR=str(megatron_lm),
            PYTHON=python,
            PATH=f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}",
        )
        self.python = python
        self._data: dict[str, str] = {}
        self._base: Path | None = None

    # -------------------------------------------------------------- fixtures
    def dataset(self, name: str = "corpus") -> str:
        """An indexed dataset from the checkout's source files (``corpus``) or its documents and
        tests (``docs``); kept in the work folder between invocations."""
        if name not in self._data:
            prefix = self.work / "data" / name
            if not Path(f"{prefix}.idx").is_file():
                if name == "corpus":
                    files = sorted((self.repo / "megatron_bytescale").rglob("*.py"))
                else:
                    files = sorted([*self.repo.glob("docs/*.md"), *self.repo.glob("tests/*.py")])
                subprocess.run(
                    [self.python, "-m", "megatron_bytescale.cli", "prepare-data", "--output", str(prefix),
                     "--quiet", "--text-files", *map(str, files)],
                    check=True, capture_output=True, cwd=self.repo, env=dict(self.base_env, PYTHONPATH=str(self.repo)),
                )  # fmt: skip
            self._data[name] = str(prefix)
        return self._data[name]

    def env(self, **variables) -> dict:
        env = dict(self.base_env, DATA_PATH=self.dataset())
        env.update({k: str(v) for k, v in variables.items()})
        return env

    def base(self) -> Path:
        """A checkpoint folder of 4 iterations on 2 ranks, saved at 2 and 4 (torch_dist, manifests)."""
        if self._base is None:
            save = self.work / "base-ckpt"
            shutil.rmtree(save, ignore_errors=True)
            run = Run(
                self.work,
                self.repo,
                self.base_env,
                self.env(SAVE_DIR=save, SAVE_INTERVAL=2),
                ["--exit-interval", "4"],
                "base",
            )
            rc, seconds, _ = run.finish(900)
            if rc != 0 or not (save / "iter_0000004").is_dir():
                raise SystemExit(f"the base run failed (exit {rc}, {seconds:.0f} s); see {run.log_path}")
            print(f"(base checkpoint: iterations 2 and 4 in {save}, {seconds:.0f} s)", flush=True)
            self._base = save
        return self._base

    def copy_of_base(self, name: str) -> Path:
        target = self.work / f"{name}-ckpt"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.base(), target)
        return target

    def resume(self, name: str, save: Path, *flags: str, timeout_s: float = 600, **variables) -> tuple[Run, tuple]:
        """Resume ``save`` for two iterations (5, 6), no further save unless asked."""
        variables = dict(dict(SAVE_DIR=save, LOAD_DIR=save, SAVE_INTERVAL=100), **variables)
        run = Run(self.work, self.repo, self.base_env, self.env(**variables), ["--exit-interval", "6", *flags], name)
        return run, run.finish(timeout_s)

    # -------------------------------------------------------------- helpers
    @staticmethod
    def outcome(case: str, what: str, run: Run, result: tuple) -> Outcome:
        rc, seconds, left = result
        iterations, lines = summary(run.log())
        return Outcome(case, what, run.command, rc, round(seconds, 1), iterations, lines, left)

    def mounted_tmpfs(self, case: str, what: str, options: str, prepare: str, *flags: str) -> Outcome:
        """Run train_local.sh with SAVE_DIR on a tmpfs mounted with ``options`` (after the shell
        command ``prepare``) in a private mount namespace; list SAVE_DIR there afterwards."""
        mnt = self.work / f"{case}-mnt"
        mnt.mkdir(exist_ok=True)
        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", str(mnt)],
            capture_output=True, text=True,
        )  # fmt: skip
        if probe.returncode != 0:
            return Outcome(case, what, why=f"no private tmpfs here: {probe.stderr.strip()[:200]}")
        save = mnt / "ckpt"
        listing = self.work / f"{case}-listing.txt"
        inner = (
            f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(mnt))} && {prepare} || exit 99; "
            f'bash "$0" "$@"; rc=$?; ls -la {shlex.quote(str(save))} > {shlex.quote(str(listing))} 2>&1; exit $rc'
        )
        argv = ["unshare", "--mount", "--propagation", "private", "bash", "-c", inner,
                str(self.repo / "scripts/train_local.sh"), *FLAGS, "--exit-interval", "2", *flags]  # fmt: skip
        log = self.work / f"{case}.log"
        t0 = time.monotonic()
        with open(log, "w") as out:
            env = self.env(SAVE_DIR=save, SAVE_INTERVAL=2)
            proc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.repo, timeout=900)
        seconds = time.monotonic() - t0
        iterations, lines = summary(log.read_text(errors="replace"))
        command = f"(in a mount namespace: mount -t tmpfs -o {options} tmpfs {mnt}; {prepare}) SAVE_DIR={save} ..."
        o = Outcome(case, what, command, proc.returncode, round(seconds, 1), iterations, lines)
        if listing.exists():
            o.facts.append("--save afterwards: " + " | ".join(listing.read_text().strip().splitlines()[1:]))
        return o


CASES: dict[str, tuple[str, Callable[[Battery], Outcome]]] = {}


def case(name: str, what: str):
    def register(function):
        CASES[name] = (what, function)
        return function

    return register


def _first_iteration_is(o: Outcome, first: int) -> bool:
    return bool(o.iterations) and o.iterations[0] == first


def _one_error(o: Outcome, *needles: str) -> bool:
    errors = [line for line in o.lines if line.startswith("error")]
    return len(errors) == 1 and all(n in errors[0] for n in needles) and not any("Traceback" in x for x in o.lines)


@case("tracker-deleted", "latest_checkpointed_iteration.txt deleted, iter_2 and iter_4 verified: resume with --load")
def tracker_deleted(b: Battery) -> Outcome:
    save = b.copy_of_base("tracker-deleted")
    (save / "latest_checkpointed_iteration.txt").unlink()
    before = {i: digest(save / i) for i in ("iter_0000002", "iter_0000004")}
    run, result = b.resume("tracker-deleted", save, SAVE_INTERVAL=2)
    o = b.outcome("tracker-deleted", CASES["tracker-deleted"][0], run, result)
    changed = [i for i, d in before.items() if not (save / i).is_dir() or digest(save / i) != d]
    o.facts.append(f"checkpoint folders rewritten: {', '.join(changed) or 'none'}")
    o.holds = _first_iteration_is(o, 5) and not changed and o.rc == 0
    o.why = "resumed at iteration 5, nothing overwritten" if o.holds else "did not resume from iteration 4"
    return o


@case("save-holds-checkpoints", "--save holds iter_2 and iter_4, no --load: a fresh run would overwrite them")
def save_holds_checkpoints(b: Battery) -> Outcome:
    save = b.copy_of_base("save-holds")
    before = {i: digest(save / i) for i in ("iter_0000002", "iter_0000004")}
    run = Run(b.work, b.repo, b.base_env, b.env(SAVE_DIR=save, SAVE_INTERVAL=2), ["--exit-interval", "2"], "save-holds")
    o = b.outcome("save-holds-checkpoints", CASES["save-holds-checkpoints"][0], run, run.finish(600))
    changed = [i for i, d in before.items() if digest(save / i) != d]
    o.facts.append(f"checkpoint folders rewritten: {', '.join(changed) or 'none'}")
    o.holds = not changed and o.rc == 2 and _one_error(o, "--load")
    o.why = "refused in one line, nothing overwritten" if o.holds else "not refused in one line"
    return o


def _changed_stream(b: Battery, name: str, needle: str, *flags: str) -> Outcome:
    run, result = b.resume(name, b.copy_of_base(name), *flags)
    o = b.outcome(name, CASES[name][0], run, result)
    o.holds = o.rc == 2 and not o.iterations and _one_error(o, needle)
    o.why = f"refused in one line naming {needle}" if o.holds else "not refused"
    return o


@case("step-tokens-changed", "resume with --hdp-step-tokens 2048 (saved with the default, 4 x 256 = 1024)")
def step_tokens_changed(b: Battery) -> Outcome:
    return _changed_stream(b, "step-tokens-changed", "--hdp-step-tokens", "--hdp-step-tokens", "2048")


@case("seed-changed", "resume with --seed 7 (saved with Megatron's default 1234)")
def seed_changed(b: Battery) -> Outcome:
    return _changed_stream(b, "seed-changed", "--seed", "--seed", "7")


@case("step-tokens-changed-deliberately", "the same with --hdp-accept-data-change")
def step_tokens_accepted(b: Battery) -> Outcome:
    name = "step-tokens-changed-deliberately"
    run, result = b.resume(name, b.copy_of_base(name), "--hdp-step-tokens", "2048", "--hdp-accept-data-change")
    o = b.outcome(name, CASES[name][0], run, result)
    said = " ".join(o.lines)
    o.holds = o.rc == 0 and _first_iteration_is(o, 5) and "continues where the checkpoint left it" in said
    o.why = "continued from the recorded position, saying so" if o.holds else "did not continue"
    return o


@case("garbage-tracker", "the tracker holds 'abc'")
def garbage_tracker(b: Battery) -> Outcome:
    save = b.copy_of_base("garbage-tracker")
    (save / "latest_checkpointed_iteration.txt").write_text("abc")
    run, result = b.resume("garbage-tracker", save)
    o = b.outcome("garbage-tracker", CASES["garbage-tracker"][0], run, result)
    o.holds = (o.rc == 0 and _first_iteration_is(o, 5)) or (o.rc == 2 and _one_error(o))
    o.why = (
        "resumed from the newest verified iteration, or one error"
        if o.holds
        else f"exit {o.rc}, trained {o.iterations}"
    )
    return o


def _swapped_bin(b: Battery) -> str:
    """The corpus with its .bin replaced by other tokens of the same byte size (the docs' dataset, tiled)."""
    import numpy as np

    source, other = b.dataset(), b.dataset("docs")
    prefix = str(b.work / "data" / "swapped")
    for suffix in (".idx", ".bytescale.json"):
        shutil.copy(source + suffix, prefix + suffix)
    size = Path(source + ".bin").stat().st_size
    tokens = np.fromfile(other + ".bin", dtype=np.uint16)
    tiled = np.resize(tokens, size // 2)
    assert not np.array_equal(tiled, np.fromfile(source + ".bin", dtype=np.uint16))
    tiled.tofile(prefix + ".bin")
    return prefix


@case("bin-swapped", "a .bin from another corpus, same byte size, beside the original .idx and sidecar")
def bin_swapped(b: Battery) -> Outcome:
    prefix = _swapped_bin(b)
    run = Run(b.work, b.repo, b.base_env, b.env(DATA_PATH=prefix), ["--exit-interval", "2"], "bin-swapped")
    o = b.outcome("bin-swapped", CASES["bin-swapped"][0], run, run.finish(600))
    o.holds = o.rc == 2 and not o.iterations and _one_error(o, ".bin")
    o.why = "refused in one line" if o.holds else f"trained {o.iterations}"
    return o


@case("dataset-changed", "resume on another dataset (the docs' corpus) than the checkpoint was trained on")
def dataset_changed(b: Battery) -> Outcome:
    save = b.copy_of_base("dataset-changed")
    run, result = b.resume("dataset-changed", save, DATA_PATH=b.dataset("docs"))
    o = b.outcome("dataset-changed", CASES["dataset-changed"][0], run, result)
    o.holds = o.rc == 2 and not o.iterations and _one_error(o, "dataset")
    o.why = "refused in one line naming the dataset" if o.holds else f"trained {o.iterations}"
    return o


def _planner_of(run: Run, rank_index: int = 0) -> int | None:
    ranks = run.ranks()
    if len(ranks) <= rank_index:
        return None
    kids = [p for p in descendants(ranks[rank_index]) if "megatron_bytescale.data.plan_ahead" in _cmdline(p)]
    return kids[0] if kids else None


def _planner_case(b: Battery, name: str, sig: int, patience_s: float) -> Outcome:
    run = Run(b.work, b.repo, b.base_env, b.env(HDP_PLAN_AHEAD=2), [], name)
    planner = None
    if run.wait_for(lambda log: len(ITERATION.findall(log)) >= 2, 600):
        planner = _planner_of(run)
    if planner is None:
        o = b.outcome(name, CASES[name][0], run, run.finish(5))
        o.why = "no planning process found"
        return o
    parent = _stat(planner)[0]
    os.kill(planner, sig)
    t_signal = time.monotonic()
    lines_then = len(run.log().splitlines())
    stopped_at = None
    while time.monotonic() - t_signal < patience_s and run.proc.poll() is None:
        time.sleep(0.5)
    if run.proc.poll() is None:
        stopped_at = time.monotonic() - t_signal
        run.proc.send_signal(signal.SIGTERM)  # as an operator would, after waiting
    rc, seconds, left = run.finish(60)
    iterations, lines = summary(run.log())
    o = Outcome(name, CASES[name][0], run.command, rc, round(seconds, 1), iterations, lines, left)
    o.facts.append(f"signal {signal.Signals(sig).name} to rank 0's planning process (pid {planner}, parent {parent})")
    new = run.log().splitlines()[lines_then:]
    if stopped_at is not None:
        o.facts.append(
            f"still running {stopped_at:.0f} s after the signal ({len(new)} lines of output meanwhile): SIGTERM sent"
        )
    else:
        o.facts.append(f"the launcher exited {seconds - (t_signal - run.t0):.1f} s after the signal")
    named = any("planning process" in line and line.startswith("error") for line in lines)
    o.holds = stopped_at is None and named and not left and not any("Traceback" in x for x in lines)
    o.why = "named in one line within seconds, nothing left" if o.holds else "not named in time, or left processes"
    return o


@case("planner-stopped", "SIGSTOP to rank 0's planning process (data/plan_ahead.py) at iteration 2")
def planner_stopped(b: Battery) -> Outcome:
    return _planner_case(b, "planner-stopped", signal.SIGSTOP, 120)


@case("planner-killed", "SIGKILL to rank 0's planning process at iteration 2")
def planner_killed(b: Battery) -> Outcome:
    return _planner_case(b, "planner-killed", signal.SIGKILL, 120)


def _launcher_signal(b: Battery, name: str, sig: int) -> Outcome:
    run = Run(b.work, b.repo, b.base_env, b.env(), [], name)
    run.wait_for(lambda log: len(ITERATION.findall(log)) >= 2, 600)
    t_signal = time.monotonic()
    run.proc.send_signal(sig)
    rc, seconds, left = run.finish(60)
    iterations, lines = summary(run.log())
    o = Outcome(name, CASES[name][0], run.command, rc, round(seconds, 1), iterations, lines, left)
    o.facts.append(f"the launcher exited {time.monotonic() - t_signal - 2:.1f} s after the signal")
    expected = 128 + sig
    o.holds = rc == expected and lines[-1:] == ["interrupted"] and not left and not any("Traceback" in x for x in lines)
    o.why = (
        f"'interrupted', exit {expected}, nothing left" if o.holds else f"expected 'interrupted' and exit {expected}"
    )
    return o


@case("launcher-sigterm", "SIGTERM to the launcher (train_local.sh execs it) at iteration 2")
def launcher_sigterm(b: Battery) -> Outcome:
    return _launcher_signal(b, "launcher-sigterm", signal.SIGTERM)


@case("launcher-sigint", "SIGINT to the launcher at iteration 2")
def launcher_sigint(b: Battery) -> Outcome:
    return _launcher_signal(b, "launcher-sigint", signal.SIGINT)


@case("rank-killed", "SIGKILL to rank 1 at iteration 2: which rank does the launcher name?")
def rank_killed(b: Battery) -> Outcome:
    run = Run(b.work, b.repo, b.base_env, b.env(), [], "rank-killed")
    run.wait_for(lambda log: len(ITERATION.findall(log)) >= 2, 600)
    ranks = run.ranks()
    victim = ranks[1] if len(ranks) > 1 else None
    if victim:
        os.kill(victim, signal.SIGKILL)
    o = b.outcome("rank-killed", CASES["rank-killed"][0], run, run.finish(120))
    o.facts.append(f"ranks {ranks}; SIGKILL to pid {victim}")
    errors = [line for line in o.lines if line.startswith("error")]
    o.holds = len(errors) == 1 and f"pid {victim}" in errors[0] and "SIGKILL" in errors[0] and not o.left_behind
    o.why = "the killed rank named, with its signal" if o.holds else "the killed rank not named first"
    return o


@case("bad-dataset-in-ranks", "an .idx whose document table the launcher cannot check (negative sequence lengths)")
def bad_dataset(b: Battery) -> Outcome:
    import struct

    source = b.dataset()
    prefix = str(b.work / "data" / "bad-index")
    for suffix in (".bin", ".idx"):
        shutil.copy(source + suffix, prefix + suffix)
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    raw[34:38] = struct.pack("<i", -5)  # the first sequence's length
    Path(prefix + ".idx").write_bytes(bytes(raw))
    run = Run(b.work, b.repo, b.base_env, b.env(DATA_PATH=prefix), ["--exit-interval", "2"], "bad-dataset")
    o = b.outcome("bad-dataset-in-ranks", CASES["bad-dataset-in-ranks"][0], run, run.finish(600))
    o.holds = o.rc == 2 and _one_error(o, "bad-index.idx") and len(o.lines) == 1
    o.why = "one line" if o.holds else f"{len(o.lines)} lines"
    return o


@case("manifest-interrupted", "the only checkpoint (iter_2) lost its manifest to a kill after Megatron's tracker")
def manifest_interrupted(b: Battery) -> Outcome:
    save = b.work / "manifest-interrupted-ckpt"
    shutil.rmtree(save, ignore_errors=True)
    shutil.copytree(b.base(), save, ignore=shutil.ignore_patterns("iter_0000004"))
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    (save / "iter_0000002" / "bytescale-manifest.json").unlink()
    run, result = b.resume("manifest-interrupted", save, "--exit-interval", "3")
    o = b.outcome("manifest-interrupted", CASES["manifest-interrupted"][0], run, result)
    said = " ".join(o.lines)
    o.holds = "saved without them" not in said and "has no manifest (a kill came after" in said and o.rc == 0
    o.why = "the message names the interrupted manifest" if o.holds else "says 'saved without them'"
    return o


def _fallback(b: Battery, name: str, damage: Callable[[Path], None], nproc: int = 2) -> Outcome:
    save = b.copy_of_base(name)
    damage(save)
    run, result = b.resume(name, save, NPROC=nproc, GLOBAL_BATCH_SIZE=4)
    o = b.outcome(name, CASES[name][0], run, result)
    skipped = any("skipped checkpoint iter_" in line for line in o.lines)
    first = 3 if any("iter_0000002" in line and "verified" in line for line in o.lines) else 5
    o.holds = o.rc == 0 and skipped and _first_iteration_is(o, first) and not any("Traceback" in x for x in o.lines)
    o.why = f"stepped back, saying so, and trained from iteration {first}" if o.holds else "no fallback"
    return o


@case("tracker-missing-folder", "the tracker names iteration 6, which has no folder (2 ranks, as saved)")
def tracker_missing_folder(b: Battery) -> Outcome:
    return _fallback(b, "tracker-missing-folder", lambda s: (s / "latest_checkpointed_iteration.txt").write_text("6"))


@case("tracker-missing-folder-resize", "the same on 1 rank (Megatron's elastic path: world 2 -> 1)")
def tracker_missing_folder_resize(b: Battery) -> Outcome:
    return _fallback(
        b, "tracker-missing-folder-resize", lambda s: (s / "latest_checkpointed_iteration.txt").write_text("6"), 1
    )


def _garble(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:64] = bytes(b ^ 0xFF for b in raw[:64])
    path.write_bytes(bytes(raw))


@case("damaged-metadata", "iter_4/.metadata garbled (first 64 bytes), size unchanged")
def damaged_metadata(b: Battery) -> Outcome:
    return _fallback(b, "damaged-metadata", lambda s: _garble(s / "iter_0000004" / ".metadata"))


def _common_state(save: Path) -> Path:
    """Megatron's common state file of a torch_dist checkpoint: common.pt (core_v0.16), metadata.json (core_v0.19)."""
    folder = save / "iter_0000004"
    return folder / "common.pt" if (folder / "common.pt").exists() else folder / "metadata.json"


@case("damaged-common-state", "iter_4's common state (common.pt, or 0.19's metadata.json) garbled, size unchanged")
def damaged_common(b: Battery) -> Outcome:
    return _fallback(b, "damaged-common-state", lambda s: _garble(_common_state(s)))


@case("save-read-only", "--save on a read-only filesystem")
def save_read_only(b: Battery) -> Outcome:
    o = b.mounted_tmpfs("save-read-only", CASES["save-read-only"][0], "ro,size=1m", "true")
    o.holds = o.rc == 2 and _one_error(o, "--save") and o.seconds < 30
    o.why = "refused by the launcher in one line" if o.holds else f"exit {o.rc} after {o.seconds:.0f} s"
    return o


@case("save-full", "--save on a full filesystem")
def save_full(b: Battery) -> Outcome:
    o = b.mounted_tmpfs(
        "save-full",
        CASES["save-full"][0],
        "size=64k",
        "mkdir -p $SAVE_DIR && (cat /dev/zero > $SAVE_DIR/../fill 2>/dev/null; true)",
    )
    empty_lock = any(re.search(r"\s0 \w+\s+\d+\s+[\d:]+ \.bytescale-save\.lock", fact) for fact in o.facts)
    o.holds = o.rc == 2 and _one_error(o, "--save") and o.seconds < 30 and not empty_lock
    o.why = "refused by the launcher in one line, no lock left" if o.holds else f"exit {o.rc} after {o.seconds:.0f} s"
    return o


def _pids_with(text: str) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and text in _cmdline(int(e.name))]


@case(
    "ray-gcs-killed",
    "HDP_DATALOADER=ray on a Ray head of its own; its GCS killed at iteration 2: what outlives the job?",
)
def ray_gcs_killed(b: Battery) -> Outcome:
    import socket

    name = "ray-gcs-killed"
    temp = tempfile.mkdtemp(prefix="/tmp/rbray")  # Ray's socket paths must stay short; names this head's processes
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray_bin = str(Path(b.python).parent / "ray")
    start = [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
             f"--temp-dir={temp}", "--disable-usage-stats"]  # fmt: skip
    # its workers (the loader's actors) import the checkout under test, not an installed copy
    env = dict(b.base_env, RAY_AUTH_MODE="disabled", PYTHONPATH=str(b.repo))
    head = subprocess.run(start, env=env, capture_output=True, text=True, timeout=600)
    if head.returncode != 0:
        return Outcome(
            name, CASES[name][0], " ".join(start), head.returncode, why=f"ray start failed: {head.stderr[-300:]}"
        )
    cluster = set(_pids_with(temp))
    try:
        run = Run(b.work, b.repo, b.base_env,
                  b.env(HDP_DATALOADER="ray", HDP_RAY_ADDRESS=f"127.0.0.1:{port}", RAY_AUTH_MODE="disabled"),
                  ["--exit-interval", "8"], name)  # fmt: skip
        run.wait_for(lambda log: len(ITERATION.findall(log)) >= 2, 900)
        for pid in list(cluster):
            cluster.update(descendants(pid))
        actors = [p for p in cluster if _cmdline(p).startswith(("ray::DocumentServer", "ray::PlanScheduler"))]
        gcs = [p for p in cluster if "gcs_server" in _cmdline(p)]
        for pid in gcs:
            os.kill(pid, signal.SIGKILL)
        rc, seconds, left = run.finish(400)
        time.sleep(8)
        survivors = [p for p in actors if alive(p)]
        iterations, lines = summary(run.log())
        o = Outcome(name, CASES[name][0], run.command, rc, round(seconds, 1), iterations, lines, left)
        o.facts.append(f"the loader's actors {actors}; SIGKILL to the head's gcs_server {gcs} at iteration 2")
        o.facts.append(f"actors alive 10 s after the job ended: {survivors or 'none'}")
        o.holds = bool(gcs) and bool(actors) and not survivors and not left
        o.why = "nothing outlived the job" if o.holds else "the loader's actors outlived the job"
        return o
    finally:  # this head's processes (ray stop would end every Ray on the machine)
        for pid in sorted({*cluster, *_pids_with(temp)}):
            for p in [pid, *descendants(pid)]:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_DIR"), help="a Megatron-LM checkout")
    parser.add_argument("--repo", default=str(ROOT), help="the checkout whose scripts/train_local.sh runs")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--work", help="a folder for datasets, checkpoints and logs (default: a temporary one)")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true", help="name the cases and exit")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args(argv)
    if args.list:
        for name, (what, _) in CASES.items():
            print(f"{name}: {what}")
        return 0
    if not args.megatron_lm or not (Path(args.megatron_lm) / "pretrain_gpt.py").is_file():
        parser.error("--megatron-lm (or MEGATRON_LM_DIR) must name a Megatron-LM checkout")
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; --list names them")
    work = Path(args.work or tempfile.mkdtemp(prefix="reliability-battery-"))
    work.mkdir(parents=True, exist_ok=True)
    battery = Battery(Path(args.repo).resolve(), args.python, Path(args.megatron_lm).resolve(), work)
    print(f"battery: {len(names)} cases, Megatron-LM {args.megatron_lm}, checkout {args.repo}, work {work}", flush=True)
    print("every command below runs with: " + " ".join(f"{k}={v}" for k, v in ENVIRONMENT.items()), flush=True)
    outcomes = []
    for name in names:
        what, function = CASES[name]
        try:
            outcome = function(battery)
        except Exception as exc:  # noqa: BLE001 - one case's harness failure must not end the battery
            outcome = Outcome(name, what, why=f"the case itself failed: {type(exc).__name__}: {exc}")
        outcomes.append(outcome)
        print(outcome.text() + "\n", flush=True)
    held = sum(o.holds for o in outcomes)
    print(f"battery: {held} of {len(outcomes)} cases hold")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    return 0 if held == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
