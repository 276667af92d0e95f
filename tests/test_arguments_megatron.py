"""HDP flags inside Megatron-LM's real argument system (core_v0.16.1 checkout).

Runs only when MEGATRON_LM_DIR points at a Megatron-LM checkout (skipped otherwise; a skip is
not a pass). The checks run in a subprocess with the checkout first on PYTHONPATH (one for all
of them, ``run``): Megatron's parser plus add_hdp_arguments, Megatron's validate_args, then
validate_hdp_args.
Optional modules Megatron's training package imports but does not need for argument handling
(triton, regex) are stubbed when absent, so this also runs on a CPU-only machine (where Megatron's
validate_args cannot take its CUDA-only branches, e.g. --context-parallel-size > 1).
"""

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from megatron_lm import MEGATRON_LM_DIR, needs_tree

ROOT = Path(__file__).resolve().parent.parent
pytestmark = needs_tree

PRELUDE = r"""
import json, os, re, sys
import megatron_bytescale  # first: where triton is missing, its stand-ins for megatron-core's kernel modules
from megatron.training.arguments import add_megatron_arguments, validate_args
import argparse
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.megatron.arguments import (
    MEGATRON_ARGS_READ, MEGATRON_DERIVED_ARGS, add_hdp_arguments, validate_hdp_args)
from megatron_bytescale.planner.specs import read_args_file

def megatron_parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return add_hdp_arguments(parser)

def validated(extra):
    argv = read_args_file("configs/models/tiny.args") + [
        "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
        "--global-batch-size", "16", "--train-iters", "10", "--lr", "1e-4",
        "--tokenizer-type", "NullTokenizer", "--bf16", "--data-path", "data/corpus", "--eval-iters", "0",
        "--eval-interval", "10",
        "--attention-dropout", "0.0"] + extra
    args = megatron_parser().parse_args(argv)
    args.rank, args.world_size = 0, 8
    validate_args(args, {})
    return validate_hdp_args(args)
"""


# One Python process runs every check of this module (and test_scripts.py's): importing
# Megatron's training package takes most of a check's ~10 s, so each check's body is sent to a
# process that imported it once and runs there in a fresh namespace, its printed lines sent back.
# (Bodies only parse and validate: nothing they do outlives them but the imports.)
SERVE = r"""
import contextlib, io, traceback
_fresh = dict(globals())
for _request in sys.stdin:
    _printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(_printed):
            exec(json.loads(_request), dict(_fresh))
        _reply = {"printed": _printed.getvalue(), "error": None}
    except BaseException:
        _reply = {"printed": _printed.getvalue(), "error": traceback.format_exc()}
    sys.__stdout__.write("@@reply " + json.dumps(_reply) + "\n")
    sys.__stdout__.flush()
"""
TIMEOUT = 300  # seconds a check may take (the first one includes the imports)
_worker: dict = {}


def _server() -> subprocess.Popen:
    proc = _worker.get("proc")
    if proc is None or proc.poll() is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM_DIR, str(ROOT)]), WORLD_SIZE="8", RANK="0")
        env.pop("LOCAL_WORLD_SIZE", None)
        log = tempfile.TemporaryFile("w+")  # its stderr: a file, so nothing blocks on a full pipe
        proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + SERVE],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        atexit.register(proc.kill)
        _worker.update(proc=proc, log=log)
    return proc


def run(body: str) -> dict:
    """Run ``body`` after PRELUDE in the checks' process; the JSON object it printed last."""
    proc = _server()
    proc.stdin.write(json.dumps(body) + "\n")
    proc.stdin.flush()
    watchdog = threading.Timer(TIMEOUT, proc.kill)  # a hung check ends the process: EOF below
    watchdog.start()
    try:
        line = ""
        while line := proc.stdout.readline():
            if line.startswith("@@reply "):
                break
    finally:
        watchdog.cancel()
    if not line:
        log = _worker["log"]
        log.seek(0)
        raise AssertionError(f"the checks' process ended (exit {proc.wait()}): {log.read()[-4000:]}")
    reply = json.loads(line[len("@@reply ") :])
    assert reply["error"] is None, reply["error"][-4000:]
    return json.loads(reply["printed"].strip().splitlines()[-1])


def test_megatron_has_every_arg_we_read_and_none_of_ours():
    out = run(
        """
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
dests = {a.dest for a in parser._actions}
options = {o for a in parser._actions for o in a.option_strings}
ours = argparse.ArgumentParser(); add_hdp_arguments(ours)
print(json.dumps({"missing": sorted(set(MEGATRON_ARGS_READ) - dests),
                  "clash": sorted({o for a in ours._actions for o in a.option_strings if o not in ("-h", "--help")} &
                  options)}))
"""
    )
    assert out == {"missing": [], "clash": []}


def test_the_launchers_parser_matches_megatrons():
    """megatron/preflight.py reads some Megatron flags without Megatron: each with Megatron's type,
    number of values and default; and on a real command line both parsers give the same values."""
    out = run(
        """
from megatron_bytescale.megatron import preflight
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
by_flag = {o: a for a in parser._actions for o in a.option_strings}
kinds = {int: "int", float: "float", str: "str", None: "str"}
wrong = []
for flag, kind, default in preflight.MEGATRON_FLAGS:
    a = by_flag.get(flag)
    if a is None:
        wrong.append([flag, "not a Megatron flag"]); continue
    if isinstance(a, argparse._StoreTrueAction):
        theirs = "true"
    elif a.nargs in ("*", "+"):
        theirs = "list"
    elif a.nargs == 3:
        theirs = "ints3"
    else:
        theirs = kinds.get(a.type, repr(a.type))
    if theirs != kind or a.default != default:
        wrong.append([flag, theirs, a.default, kind, default])
    if a.dest != preflight.MEGATRON_DESTS.get(flag, flag[2:].replace("-", "_")):
        wrong.append([flag, "attribute", a.dest])
argv = read_args_file("configs/models/tiny.args") + ["--seq-length", "4096", "--micro-batch-size", "1", "--lr", "1e-4",
    "--data-path", "a", "--spec", "m", "n", "--rampup-batch-size", "1", "2", "3", "--lr-warmup-iters", "5",
    "--train-iters", "9", "--save", "s", "--microbatch-group-size-per-virtual-pipeline-stage", "2",
    "--hybrid-data-parallel", "--hdp-token-capacity", "8K"]
theirs = vars(megatron_parser().parse_args(argv))
ours = vars(preflight.parse(argv))
differ = sorted(k for k in ours if theirs.get(k, "absent") != ours[k])
print(json.dumps({"wrong": wrong, "differ": differ}))
"""
    )
    assert out == {"wrong": [], "differ": []}


def test_valid_command_line_after_megatron_validation():
    out = run(
        """
args = validated(["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "1K"])
print(json.dumps({k: getattr(args, k) for k in ("hdp_size", "hdp_balance", "hdp_token_capacity", "dataloader_type")}))
"""
    )
    assert out == {"hdp_size": 8, "hdp_balance": "dp", "hdp_token_capacity": 1024, "dataloader_type": "external"}


def test_virtual_pipeline_stages_after_megatron_validation():
    out = run(
        """
from megatron_bytescale.megatron.arguments import planner_config_from_args
args = validated(["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "1K",
                  "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"])
print(json.dumps({"hdp_size": args.hdp_size, "balance": args.hdp_balance, "vpp":
args.virtual_pipeline_model_parallel_size,
                  "virtual_stages": planner_config_from_args(args).virtual_stages}))
"""
    )
    assert out == {"hdp_size": 4, "balance": "pp", "vpp": 2, "virtual_stages": 2}


# a valid HDP command line, and virtual stages (PP 2 x V 2 of the tiny model's 4 layers)
HDP_1K = ["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "1K"]
VPP_2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--hybrid-data-parallel", "--hdp-token-capacity", "1K"], "add --calculate-per-token-loss"),
        (HDP_1K + ["--micro-batch-size", "2"], "use --micro-batch-size 1"),
        (
            HDP_1K + VPP_2 + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
            "--overlap-param-gather with 2 virtual pipeline stages per rank",
        ),
        (
            HDP_1K + VPP_2 + ["--microbatch-group-size-per-virtual-pipeline-stage", "4"],
            "--microbatch-group-size-per-virtual-pipeline-stage 4: the HDP step picks",
        ),
        (["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "256"], "does not fit"),
    ],
)
def test_conflicts_after_megatron_validation(extra, message):
    out = run(
        f"""
try:
    validated({extra!r})
    print(json.dumps({{"error": None}}))
except ConfigError as exc:
    print(json.dumps({{"error": str(exc)}}))
"""
    )
    assert out["error"] is not None and message in out["error"]


# Flags of core_v0.17-0.19 that HDP refuses (docs/cluster.md); on a tree without the flag
# (core_v0.16) the parser must not know it, so the refusal has nothing to guard.
NEWER_FLAGS = {
    "--eval-micro-batch-size": (["--eval-micro-batch-size", "2"], "drop it"),
    "--eval-global-batch-size": (["--eval-global-batch-size", "32"], "--hdp-step-tokens"),
    "--moe-paged-stash": (["--moe-paged-stash"], "HDP step replaces"),
}


def test_newer_megatron_flags_are_refused_or_absent():
    out = run(
        f"""
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
known = {{o for a in parser._actions for o in a.option_strings}}
result = {{}}
for flag, (extra, _) in {NEWER_FLAGS!r}.items():
    if flag not in known:
        result[flag] = None
        continue
    try:
        validated(["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "4K"] + extra)
        result[flag] = "accepted"
    except (ConfigError, AssertionError) as exc:
        result[flag] = str(exc)
known_masking = "--dataloader-inter-document-masking" in known
if known_masking:
    args = validated(["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "4K",
                      "--dataloader-inter-document-masking"])
print(json.dumps({{"refusals": result, "masking_accepted": known_masking}}))
"""
    )
    from megatron_bytescale.megatron_era import Era

    from megatron_lm import era

    tree_era = era()
    for flag, (_, message) in NEWER_FLAGS.items():
        got = out["refusals"][flag]
        if tree_era is Era.V016:
            assert got is None, (flag, got)
        else:
            assert got is not None and message in got, (flag, got)
    assert out["masking_accepted"] == (tree_era is Era.V019)
