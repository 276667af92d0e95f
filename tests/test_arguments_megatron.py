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
from pathlib import Path
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
    # parsed, then what the ranks run: the flag table's refusals on the values as given,
    # Megatron's validate_args, validate_hdp_args
    from megatron_bytescale.megatron import flag_table
    argv = read_args_file("configs/models/tiny.args") + [
        "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
        "--global-batch-size", "16", "--train-iters", "10", "--lr", "1e-4",
        "--tokenizer-type", "NullTokenizer", "--bf16", "--data-path", "data/corpus", "--eval-iters", "0",
        "--eval-interval", "10",
        "--attention-dropout", "0.0"] + extra
    args = megatron_parser().parse_args(argv)
    args.rank, args.world_size = 0, 8
    if args.hybrid_data_parallel:
        known = {o for a in megatron_parser()._actions for o in a.option_strings}
        flag_table.refuse(args, flag_table.given_flags(argv), known)
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


def test_the_shipped_parser_spec_is_megatrons():
    """The launcher reads a command line with the parser spec the package ships for this tree
    (parser_spec.find_shipped): it must be the real parser's, action for action, and its
    sources must be the files the real parser's flags come from."""
    out = run(
        """
from megatron_bytescale.megatron import parser_spec
real = json.loads(json.dumps(parser_spec.spec_of(*parser_spec.megatron_parser())))
shipped = parser_spec.find_shipped(Path(os.environ["MEGATRON_LM_DIR"]))
differ = None if shipped is None else [
    [a, b] for a, b in zip(real["actions"], shipped["actions"]) if a != b][:1]
print(json.dumps({"shipped": shipped is not None, "differ": differ,
                  "same": shipped == real, "sources": real["sources"] == (shipped or {}).get("sources")}))
"""
    )
    assert out["shipped"], "no shipped parser spec matches this tree's sources"
    assert out == {"shipped": True, "differ": [], "same": True, "sources": True}, out


# command lines both parsers read (every kind of action: ints, floats, lists, choices, enums,
# store_false, Megatron's own converters, the HDP group)
COMMAND_LINES = [
    [
        "--seq-length",
        "4096",
        "--micro-batch-size",
        "1",
        "--lr",
        "1e-4",
        "--data-path",
        "a",
        "--spec",
        "m",
        "n",
        "--rampup-batch-size",
        "1",
        "2",
        "3",
        "--lr-warmup-iters",
        "5",
        "--train-iters",
        "9",
        "--save",
        "s",
        "--microbatch-group-size-per-virtual-pipeline-stage",
        "2",
        "--hybrid-data-parallel",
        "--hdp-token-capacity",
        "8K",
    ],
    [
        "--num-layers",
        "4",
        "--attention-backend",
        "flash",
        "--no-rope-fusion",
        "--window-size",
        "64,0",
        "--moe-router-load-balancing-type",
        "aux_loss",
        "seq_aux_loss",
        "--moe-aux-loss-coeff",
        "1e-2",
        "1e-3",
        "--position-embedding-type",
        "rope",
        "--bf16",
        "--ckpt-format",
        "torch",
        "--exit-signal-handler",
    ],
]


def test_the_launchers_parser_reads_a_command_line_as_megatrons():
    """The parser the launcher builds from the spec (preflight.parser_for, no torch) gives the
    same values as Megatron's on real command lines; Megatron's own converters' values stay
    text in the launcher (Megatron converts them in the ranks)."""
    out = run(
        f"""
from megatron_bytescale.megatron import parser_spec, preflight
tree = os.environ["MEGATRON_LM_DIR"]
text = {{a["dest"] for a in parser_spec.load(tree)["actions"] if a["type"] == "text"}}
result = []
# Megatron's parser as a plain shell builds it (two defaults read WORLD_SIZE and LOCAL_RANK)
for argv in {COMMAND_LINES!r}:
    theirs = vars(add_hdp_arguments(parser_spec.megatron_parser()[0]).parse_args(argv))
    ours = vars(preflight.parse(argv, tree))
    result.append(sorted(k for k in theirs if k not in text and parser_spec._plain(theirs[k]) != ours.get(k)))
    result.append(sorted(set(theirs) ^ set(ours)))
print(json.dumps(result))
"""
    )
    assert out == [[]] * (2 * len(COMMAND_LINES))


# what the flag table's classification check finds on a parser: option strings the table lacks
# for this tree, rows claiming this tree that the parser lacks, and rows whose attribute differs
CLASSIFY = """
from megatron_bytescale.megatron import flag_table
def classify(parser, tree):
    table = flag_table.rows()
    options = {o: a.dest for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    return {
        "unclassified": sorted(o for o in options if o not in table or tree not in table[o].trees),
        "gone": sorted(f for f, r in table.items() if tree in r.trees and f not in options),
        "attribute": sorted(o for o in options if o in table and options[o] not in table[o].dests),
    }
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
"""


def _tree_key() -> str:
    from megatron_bytescale.megatron.flag_table import TREES

    name = Path(MEGATRON_LM_DIR).resolve().name
    keys = [key for key, tree in TREES.items() if tree == name]
    assert keys, f"{name}: not one of the trees the flag table covers ({', '.join(TREES.values())})"
    return keys[0]


def test_every_megatron_flag_is_classified():
    """Every option string of this tree's real parser has its row in megatron_flags.tsv (for
    this tree, with Megatron's attribute), and no row claims a flag the parser lacks: a new
    Megatron release cannot be accepted silently."""
    out = run(CLASSIFY + f"print(json.dumps(classify(parser, {_tree_key()!r})))")
    assert out == {"unclassified": [], "gone": [], "attribute": []}, out


def test_a_flag_the_table_does_not_know_fails_the_classification():
    """The same check on this parser with one flag added, as a newer Megatron would add it."""
    out = run(
        CLASSIFY
        + "parser.add_argument('--brand-new-attention-trick', type=int, default=0)\n"
        + f"print(json.dumps(classify(parser, {_tree_key()!r})))"
    )
    assert out == {"unclassified": ["--brand-new-attention-trick"], "gone": [], "attribute": []}


# the rows whose rule refuses Megatron's own default: HDP needs another value on the command line
REQUIRED = {"--calculate-per-token-loss", "--attention-dropout", "--micro-batch-size"}


def test_no_refusal_rule_refuses_megatrons_default_except_the_required_values():
    out = run(
        """
from megatron_bytescale.megatron import flag_table
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
by_option = {o: a for a in parser._actions for o in a.option_strings}
refused = []
for flag, row in flag_table.rows().items():
    if row.condition is not None and flag in by_option and flag_table._refuses(*row.condition, by_option[flag].default):
        refused.append(flag)
print(json.dumps(sorted(refused)))
"""
    )
    assert set(out) == REQUIRED


def test_valid_command_line_after_megatron_validation():
    out = run(
        """
args = validated(["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "1K"])
print(json.dumps({k: getattr(args, k) for k in ("hdp_size", "hdp_balance", "hdp_token_capacity", "dataloader_type")}))
"""
    )
    assert out == {"hdp_size": 8, "hdp_balance": "dp", "hdp_token_capacity": 1024, "dataloader_type": "external"}


def test_virtual_stages_with_overlapped_param_gather_after_megatron_validation():
    """The HDP step dispatches every chunk's parameter all-gather, so Megatron's
    validation and HDP's accept virtual stages with --overlap-param-gather, and with the first
    chunk's gather in the optimizer step (which Megatron allows with virtual stages only, and
    without distributed checkpoints)."""
    out = run(
        """
common = ["--calculate-per-token-loss", "--hybrid-data-parallel", "--hdp-token-capacity", "1K",
          "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
a = validated(common)
b = validated(common + ["--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"])
print(json.dumps([a.virtual_pipeline_model_parallel_size, a.overlap_param_gather,
                  b.overlap_param_gather_with_optimizer_step]))
"""
    )
    assert out == [2, True, True]


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
        (HDP_1K + ["--window-size", "64,0"], "no sliding window"),
        (HDP_1K + ["--softmax-type", "learnable"], "no attention sinks"),
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
