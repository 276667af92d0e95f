"""``python -m megatron_bytescale.launch``: the runtime equivalent of the patch series.

Megatron-LM's training package is not installed here (and its pretrain() needs CUDA), so each
test runs the launcher in a subprocess against a stand-in ``megatron.training`` with the same
call structure as core_v0.16.1 (``megatron`` is a namespace package, so the stand-in sits next
to the installed megatron-core): pretrain() parses Megatron's flags plus the extra_args_provider,
calls ``initialize.validate_args`` through the module, then the providers, then
``get_forward_backward_func()`` through the training module. A stand-in pretrain_gpt.py calls
pretrain() as the real one does. The real script runs under the launcher in the GPU smoke test
(scripts/gpu/smoke_pretrain_gpt.sh).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

TRAINING_INIT = """
from .global_vars import get_args
from .training import pretrain
"""
GLOBAL_VARS = """
_ARGS = None
def get_args():
    return _ARGS
def set_args(args):
    global _ARGS
    _ARGS = args
"""
ARGUMENTS = """
import argparse, json, os
def parse_args(extra_args_provider=None):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--seq-length", type=int, default=4096)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args()
def validate_args(args, defaults={}):
    # what core_v0.16.1's validate_args leaves behind for the values the test does not set
    for name, value in json.loads(os.environ["FAKE_MEGATRON_DEFAULTS"]).items():
        if not hasattr(args, name):
            setattr(args, name, value)
    args.megatron_validated = True
"""
INITIALIZE = """
from .arguments import parse_args, validate_args
from .global_vars import set_args
def initialize_megatron(extra_args_provider=None, args_defaults={}):
    args = parse_args(extra_args_provider)
    validate_args(args, args_defaults)
    set_args(args)
"""
TRAINING = """
import json, os
from megatron.training import initialize
from megatron.training.global_vars import get_args

def megatron_schedule(**kwargs):
    return "megatron schedule"

def get_forward_backward_func(*args, **kwargs):
    return megatron_schedule

def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, **kwargs):
    initialize.initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    args = get_args()
    fb = get_forward_backward_func()
    report = {
        "validated": getattr(args, "megatron_validated", False),
        "hdp_size": getattr(args, "hdp_size", None),
        "dataloader_type": getattr(args, "dataloader_type", None),
        "forward_backward": getattr(fb, "__qualname__", str(fb)),
        "is_distributed": getattr(train_valid_test_dataset_provider, "is_distributed", False),
    }
    if not args.hybrid_data_parallel:
        report["model"] = model_provider(pre_process=True, post_process=True)
        report["data"] = train_valid_test_dataset_provider([1, 1, 1])
        report["step"] = forward_step_func(iter(["batch"]), "model")
    else:
        # HDP forward step: one MicroBatchData in, pretrain_gpt's loss_func out
        import torch
        from megatron_bytescale.planner.contract import MicroBatch
        from megatron_bytescale.runtime.batch import MicroBatchData
        mb = MicroBatchData(MicroBatch(()), torch.arange(5), torch.arange(1, 6), torch.ones(5), torch.arange(5))
        calls = []
        def model(tokens, position_ids, attention_mask, labels=None, loss_mask=None):
            calls.append([list(tokens.shape), position_ids.tolist(), attention_mask])
            return torch.zeros(1, 5)
        output, loss = forward_step_func(iter([mb]), model)
        report["model_call"] = calls[0]
        report["loss"] = loss(output)
    with open(os.environ["FAKE_MEGATRON_REPORT"], "w") as f:
        json.dump(report, f)
"""
SCRIPT = """
from functools import partial
from megatron.training import get_args, pretrain

def loss_func(loss_mask, output_tensor, model=None):
    return "pretrain_gpt loss_func"

def forward_step(data_iterator, model, return_schedule_plan=False):
    return "megatron forward_step " + next(data_iterator)

def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    return "megatron datasets"

def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    return "gpt model, spec=" + str(args.spec if hasattr(args, "spec") else None)

def model_provider(builder, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    return builder(get_args(), pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)

if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, partial(model_provider, gpt_builder), "encoder_or_decoder",
             forward_step, args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, extra_args_provider=None)
"""


@pytest.fixture
def stand_in(tmp_path):
    pkg = tmp_path / "site" / "megatron" / "training"
    pkg.mkdir(parents=True)
    for name, text in {
        "__init__": TRAINING_INIT,
        "global_vars": GLOBAL_VARS,
        "arguments": ARGUMENTS,
        "initialize": INITIALIZE,
        "training": TRAINING,
    }.items():
        (pkg / f"{name}.py").write_text(textwrap.dedent(text))
    script = tmp_path / "mlm" / "pretrain_gpt.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "data").mkdir()  # the launcher checks that --data-path's files exist
    for ext in (".bin", ".idx"):
        (tmp_path / "data" / f"corpus{ext}").write_bytes(b"")
    return tmp_path, script


def launch(stand_in, *flags, script=None, defaults=None):
    tmp_path, default_script = stand_in
    from test_arguments import MEGATRON  # the post-validate_args values of core_v0.16.1

    report = tmp_path / "report.json"
    values = {**MEGATRON, "spec": None, "eval_iters": 0, "valid_data_path": None, **(defaults or {})}
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path / "site")]),
        FAKE_MEGATRON_DEFAULTS=json.dumps(values),
        FAKE_MEGATRON_REPORT=str(report),
    )
    env.pop("LOCAL_WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.launch", str(script or default_script), *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_without_hdp_everything_is_megatron_s_own(stand_in):
    proc, report = launch(stand_in, "--seq-length", "2048")
    assert proc.returncode == 0, proc.stderr
    assert report["validated"] and report["hdp_size"] is None
    assert report["forward_backward"] == "megatron_schedule"
    assert report["model"] == "gpt model, spec=None"
    assert report["data"] == "megatron datasets"
    assert report["step"] == "megatron forward_step batch"
    assert report["is_distributed"] is True


def test_with_hdp_the_hooks_take_over(stand_in):
    proc, report = launch(
        stand_in,
        "--calculate-per-token-loss",
        "--seq-length",
        "4096",
        "--hybrid-data-parallel",
        "--hdp-token-capacity",
        "1K",
    )
    assert proc.returncode == 0, proc.stderr
    assert report["validated"] and report["hdp_size"] == 8 and report["dataloader_type"] == "external"
    assert report["forward_backward"] == "megatron_forward_backward"
    assert report["model_call"] == [[1, 5], [[0, 1, 2, 3, 4]], None]
    assert report["loss"] == "pretrain_gpt loss_func"


def test_hdp_conflicts_stop_the_run_with_the_config_error(stand_in):
    proc, report = launch(stand_in, "--seq-length", "4096", "--hybrid-data-parallel", "--hdp-token-capacity", "1K")
    assert proc.returncode == 2 and report is None
    assert "add --calculate-per-token-loss" in proc.stderr and "Traceback" not in proc.stderr


def test_a_patched_script_is_run_as_is(stand_in):
    tmp_path, script = stand_in
    patched = tmp_path / "mlm_patched" / "pretrain_gpt.py"  # the launcher serves pretrain_gpt.py only
    patched.parent.mkdir()
    text = (
        script.read_text()
        .replace(
            "from megatron.training import get_args, pretrain",
            "from megatron.training import get_args, pretrain\nfrom megatron_bytescale.megatron import pretrain_hooks "
            "as hdp",
        )
        .replace("extra_args_provider=None)", "extra_args_provider=hdp.extra_args_provider(None))")
    )
    patched.write_text(text)
    # wrapping pretrain as well would add the HDP flags twice (an argparse conflict)
    proc, report = launch(stand_in, "--seq-length", "2048", "--hdp-plan-ahead", "3", script=patched)
    assert proc.returncode == 2 and "only apply with --hybrid-data-parallel" in proc.stderr


def test_usage_and_bad_script():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.launch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert proc.returncode == 2 and "usage: python -m megatron_bytescale.launch" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.launch", "no_such_pretrain_gpt.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert proc.returncode == 2 and "not a Python file" in proc.stderr
