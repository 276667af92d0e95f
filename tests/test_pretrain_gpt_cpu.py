"""Megatron-LM's own training loop (``pretrain_gpt.py``, core_v0.16.1 or core_v0.19) under HDP on CPU/gloo.

Every run is the command line ``scripts/train_local.sh`` builds (tiny model, fp32, the local
transformer implementation, ``--use-distributed-optimizer``) on datasets made by
``bytescale prepare-data``; the losses are the ones Megatron logs. Runs with the same flags share
one invocation where they can (the first run also writes the checkpoint the resume tests load):

* patched ``pretrain_gpt.py`` (the series applied to a copy of the tree) on 4 ranks: the loss
  falls and validation runs; the launcher on the unpatched tree gives the very same losses;
* a stop at iteration 2 and a resume (torch_dist and torch formats, hidden dropout on) gives
  exactly the uninterrupted run's losses, gradient norms and validation loss at iterations 3-5;
* 4 HDP ranks and TP=2 x HDP=2: Megatron's iteration-1 loss equals one HDP rank's (same TP) on
  the same global batch, and the parameters after iteration 1 equal that run's (fp32 tolerance);
* the distributed optimizer with overlapped gradient reduction and parameter all-gathers:
  PP=2 x HDP=2 and virtual stages (PP=2 x V=2 x HDP=2) give the losses and gradient norms of one
  rank without PP, 3 iterations, with tied embeddings; the first chunk's gathers in the optimizer
  step give those of the same virtual stages without the overlapped flags;
* expert parallelism EP=2 with both load-balancing losses, a sigmoid router with expert bias and
  a shared expert, full recompute and the overlapped distributed optimizer on 4 ranks (a rank whose
  only slot is a padding filler among them): the losses, gradient norms and load-balancing losses
  of 2 ranks, 3 iterations; the same mixture of experts with PP=2 x HDP=2: one rank's;
* wrong launches stop with one line naming the problem, not a traceback.

Needs MEGATRON_LM_DIR (a core_v0.16.1 or core_v0.19 checkout; CI runs this file against both);
skipped, with that reason, without it.
"""

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_lm import MEGATRON_LM_DIR, ROOT, needs_tree, patched_copy, prepare_text_dataset

pytestmark = needs_tree

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")
# Megatron's load-balancing losses in the iteration line (summed over the step's micro-batches and
# data-parallel ranks, see the MoE test). Its z-loss is logged there too, but core_v0.16 logs the
# printing rank's own share (no data-parallel reduction), so only its effect on the gradients,
# in the losses and gradient norms, is compared.
ROUTER_LOSS = re.compile(r"\| ((?:seq_)?load_balancing_loss): (\S+)")
LOAD_BALANCING = ("load_balancing_loss", "seq_load_balancing_loss")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")
ERROR_LINE = re.compile(r"^error: .+$", re.M)
TIMEOUT = 300


class Run:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.proc, self.log = proc, proc.stdout + proc.stderr
        self.losses = {int(i): loss for i, loss, _ in ITERATION.findall(self.log)}
        self.grad_norms = {int(i): norm for i, _, norm in ITERATION.findall(self.log)}
        self.validation = VALIDATION.findall(self.log)
        self.router = {
            int(m.group(1)): dict(ROUTER_LOSS.findall(line))
            for line in self.log.splitlines()
            if (m := re.search(r"iteration\s+(\d+)/", line)) and ITERATION.search(line)
        }

    def summary(self) -> str:
        """The lines that tell what happened (Megatron's log is long and mostly warnings)."""
        keep = re.compile(r"iteration|checkpoint|[Ee]rror|Traceback|error:|validation")
        return "\n".join(line for line in self.log.splitlines() if keep.search(line) and "warn" not in line)[-6000:]

    def check(self) -> "Run":
        assert self.proc.returncode == 0, self.summary()
        return self


def _environment(tree: Path, **variables) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(
        MEGATRON_LM_DIR=str(tree),
        MODEL="tiny",
        PRECISION="fp32",
        TRANSFORMER_IMPL="local",
        SEQ_LENGTH="256",
        HDP_TOKEN_CAPACITY="256",
        HDP_PLAN_AHEAD="0",
        LR_WARMUP_ITERS="0",
        LOG_INTERVAL="1",
        LR="1e-3",
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS="1",
    )
    env.update({k: str(v) for k, v in variables.items()})
    return env


def train(tree: Path, *flags: str, **variables) -> Run:
    """scripts/train_local.sh with these variables and extra flags (the fusions below are
    torch.compile'd on CPU: seconds of compiling for a model this small)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/train_local.sh"), "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", *flags],
        env=_environment(tree, **variables),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    return Run(proc)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrain_gpt")


@pytest.fixture(scope="module")
def data(work):
    """Train and validation sets in Megatron's indexed format, by `bytescale prepare-data`."""
    prefixes = {}
    for name, files in (
        ("train", sorted((ROOT / "megatron_bytescale").rglob("*.py"))),
        ("valid", sorted((ROOT / "tests").glob("test_*.py"))),
    ):
        prefixes[name] = prepare_text_dataset(work / name, files, timeout=120)
    return prefixes


@pytest.fixture(scope="module")
def patched_tree(work):
    """A copy of the checkout with patches/*.patch applied (the checkout itself stays read-only)."""
    tree = patched_copy(work / "megatron-lm")
    assert "megatron_bytescale.megatron import pretrain_hooks" in (tree / "pretrain_gpt.py").read_text()
    return tree


def _hdp4(data, **variables):
    return dict(
        dict(
            NPROC=4,
            GLOBAL_BATCH_SIZE=8,
            TRAIN_ITERS=5,
            DATA_PATH=data["train"],
            VALID_DATA_PATH=data["valid"],
            EVAL_ITERS=1,
            EVAL_INTERVAL=2,
            SAVE_INTERVAL=2,
        ),
        **variables,
    )


@pytest.fixture(scope="module")
def patched_run(patched_tree, data, work):
    """4 HDP ranks, patched pretrain_gpt.py, hidden dropout on; saves torch_dist at 2 and 4."""
    return train(
        patched_tree,
        "--hidden-dropout",
        "0.1",
        "--ckpt-format",
        "torch_dist",
        **_hdp4(data, SAVE_DIR=work / "ckpt_dist"),
    ).check()


@pytest.fixture(scope="module")
def launcher_run(data, work):
    """The same through the launcher on the unpatched checkout; saves in torch format."""
    return train(
        Path(MEGATRON_LM_DIR),
        "--hidden-dropout",
        "0.1",
        "--ckpt-format",
        "torch",
        **_hdp4(data, SAVE_DIR=work / "ckpt_torch"),
    ).check()


def _resume_from(checkpoint: Path, iteration: int, work: Path) -> Path:
    """A copy of ``checkpoint`` whose tracker file names ``iteration`` (as if the run had stopped there)."""
    copy = work / f"{checkpoint.name}_at_{iteration}"
    shutil.copytree(checkpoint, copy)
    (copy / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return copy


def test_patched_pretrain_gpt_trains_and_validates_on_four_hdp_ranks(patched_run):
    assert sorted(patched_run.losses) == [1, 2, 3, 4, 5], patched_run.log[-3000:]
    losses = [float(patched_run.losses[i]) for i in (1, 2, 3, 4, 5)]
    assert losses[-1] < losses[0] - 0.05, losses
    assert [i for i, _ in patched_run.validation][:2] == ["2", "4"], patched_run.validation
    assert re.search(r"hybrid_data_parallel \.+ True", patched_run.log)
    assert re.search(r"use_distributed_optimizer \.+ True", patched_run.log)


def test_launcher_on_the_unpatched_tree_gives_the_same_losses(patched_run, launcher_run):
    assert launcher_run.losses == patched_run.losses
    assert launcher_run.grad_norms == patched_run.grad_norms
    assert launcher_run.validation == patched_run.validation


def test_the_ray_loader_trains_on_the_local_loaders_batches(launcher_run, data, work):
    """--hdp-dataloader ray (document servers and the planning actor on a Ray head of the run's
    own) gives the launcher run's losses, gradient norms and validation losses: the same
    batches, read through the Ray actors. Run on one tree (.ci/run): the loader does not
    depend on Megatron's version."""
    import socket
    import tempfile

    temp = tempfile.mkdtemp(prefix="/tmp/bsray")  # Ray's socket paths must stay short
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray = str(Path(sys.executable).parent / "ray")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))  # actors import this checkout
    start = [ray, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
             f"--temp-dir={temp}", "--disable-usage-stats"]  # fmt: skip
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=300)
    try:
        served = train(
            Path(MEGATRON_LM_DIR), "--hidden-dropout", "0.1", "--ckpt-format", "torch",
            **_hdp4(data, SAVE_DIR=work / "ckpt_ray", HDP_DATALOADER="ray", HDP_RAY_ADDRESS=f"127.0.0.1:{port}",
                    RAY_AUTH_MODE="disabled"),
        ).check()  # fmt: skip
    finally:  # this head's processes only (`ray stop` would end every Ray on the machine)
        import psutil

        head = [p for p in psutil.process_iter(["cmdline"]) if temp in " ".join(p.info["cmdline"] or ())]
        for proc in {q for p in head for q in (p, *p.children(recursive=True))}:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp, ignore_errors=True)
    assert re.search(r"hdp_dataloader \.+ ray", served.log), served.summary()
    assert served.losses == launcher_run.losses and served.grad_norms == launcher_run.grad_norms
    assert served.validation == launcher_run.validation


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_stop_and_resume_continues_the_uninterrupted_run_exactly(fmt, request, data, work):
    if fmt == "torch_dist":  # the patched run's checkpoint, resumed by the patched script
        uninterrupted, tree, checkpoint = (
            request.getfixturevalue("patched_run"),
            request.getfixturevalue("patched_tree"),
            work / "ckpt_dist",
        )
    else:  # the launcher run's, resumed by the launcher
        uninterrupted = request.getfixturevalue("launcher_run")
        tree, checkpoint = Path(MEGATRON_LM_DIR), work / "ckpt_torch"
    resumed = train(
        tree,
        "--hidden-dropout",
        "0.1",
        "--ckpt-format",
        fmt,
        **_hdp4(data, LOAD_DIR=_resume_from(checkpoint, 2, work), SAVE_INTERVAL=100),
    ).check()
    assert "successfully loaded checkpoint from" in resumed.log and sorted(resumed.losses) == [3, 4, 5], (
        resumed.summary()
    )
    print(f"{fmt}: uninterrupted {uninterrupted.losses}, resumed {resumed.losses}")
    # Megatron logs the first iteration of a run without resetting its loss accumulator
    # (training.py:1797), so the next line averages both: the resumed run's iteration 4 is the
    # mean of iterations 3 and 4; 3 and 5 stand alone, as in the uninterrupted run
    assert resumed.losses[3] == uninterrupted.losses[3] and resumed.losses[5] == uninterrupted.losses[5]
    mean = (float(uninterrupted.losses[3]) + float(uninterrupted.losses[4])) / 2
    assert abs(float(resumed.losses[4]) - mean) < 2e-6, (resumed.losses[4], mean)
    assert resumed.grad_norms == {i: uninterrupted.grad_norms[i] for i in (3, 4, 5)}
    # validation at iteration 4 on the same validation steps, with the same parameters
    assert ("4", dict(uninterrupted.validation)["4"]) in resumed.validation


def _parameters(checkpoint: Path) -> dict:
    """The model's parameters in a torch_dist checkpoint, whatever TP wrote it."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    iteration = (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip()
    out = checkpoint / "full.pt"
    dcp_to_torch_save(checkpoint / f"iter_{int(iteration):07d}", out)
    state = torch.load(out, weights_only=False)
    return {
        k: v
        for k, v in state.items()
        if not k.startswith("optimizer") and torch.is_tensor(v) and "_extra_state" not in k
    }


# TP=2 with Megatron's default initialisation: each TP shard drawn from the model-parallel RNG
# stream (per TP rank, the same on every HDP rank; on CPU cpu_compat.CpuRNGStatesTracker);
# TP=1 with --use-cpu-initialization: the full weights drawn once and split
@pytest.mark.parametrize(
    "tp, init", [(1, ("--use-cpu-initialization",)), (2, ())], ids=["tp1-cpu-init", "tp2-default-init"]
)
def test_hdp_step_equals_one_hdp_rank(tp, init, data, work):
    """Megatron's iteration-1 loss and the parameters after iteration 1: HDP over 4 ranks
    (TP=1: 4 HDP ranks; TP=2: TP=2 x HDP=2) against one HDP rank of the same TP size on the same
    global batch (no dropout). Megatron's initialisation depends on the TP size, so each TP size
    is compared with its own one-HDP-rank run. Different initial weights would differ by far
    more than the tolerance after one Adam step (which moves each weight by at most ~lr, 3e-5)."""
    common = dict(GLOBAL_BATCH_SIZE=8, TRAIN_ITERS=1, DATA_PATH=data["train"], TP=tp)
    flags = ("--hidden-dropout", "0", "--ckpt-format", "torch_dist", *init)

    def run(name, nproc):
        return name, train(Path(MEGATRON_LM_DIR), *flags, **common, NPROC=nproc, SAVE_DIR=work / f"ckpt_{name}").check()

    with ThreadPoolExecutor(2) as pool:  # both are mostly start-up: overlap them
        both = dict(pool.map(lambda a: run(*a), ((f"tp{tp}_hdp{4 // tp}", 4), (f"tp{tp}_hdp1", tp))))
    hdp, one = both[f"tp{tp}_hdp{4 // tp}"], both[f"tp{tp}_hdp1"]
    assert f"tensor model parallel with size {tp}" in hdp.log
    # Megatron prints 7 significant digits; the HDP ranks' partial sums add up in another order
    # (measured on other data: 6.648995 against 6.648994, the weights equal to 2.6e-7)
    assert abs(float(hdp.losses[1]) - float(one.losses[1])) < 5e-6, (hdp.losses, one.losses)
    assert abs(float(hdp.grad_norms[1]) - float(one.grad_norms[1])) <= 1e-3, (hdp.grad_norms, one.grad_norms)
    params_hdp, params_one = _parameters(work / f"ckpt_tp{tp}_hdp{4 // tp}"), _parameters(work / f"ckpt_tp{tp}_hdp1")
    assert params_hdp.keys() == params_one.keys() and len(params_one) >= 8  # layers are stacked
    worst = max(float((params_hdp[k].double() - params_one[k].double()).abs().max()) for k in params_one)
    print(
        f"TP={tp}: iteration-1 loss {hdp.losses[1]} (HDP={4 // tp}) vs {one.losses[1]} (one HDP rank); "
        f"max parameter difference after iteration 1: {worst:.3e}"
    )
    assert worst < 5e-6  # fp32: different summation orders, through one Adam step


def _close(run_, reference, iterations, what):
    """Megatron prints 7 digits: fp32 summation orders differ in the last."""
    assert sorted(run_.losses) == sorted(reference.losses) == list(iterations), (run_.summary(), reference.summary())
    for i in iterations:
        assert abs(float(run_.losses[i]) - float(reference.losses[i])) < 5e-6, (what, i, run_.losses, reference.losses)
        assert abs(float(run_.grad_norms[i]) - float(reference.grad_norms[i])) <= 1e-3, (
            what,
            i,
            run_.grad_norms,
            reference.grad_norms,
        )
        for name in LOAD_BALANCING:
            mine, theirs = run_.router.get(i, {}).get(name), reference.router.get(i, {}).get(name)
            assert (mine is None) == (theirs is None), (what, i, name, run_.router, reference.router)
            if mine is not None:
                assert abs(float(mine) - float(theirs)) < 5e-6, (what, i, name, run_.router, reference.router)


@pytest.fixture(scope="module")
def one_length_data(work):
    """Documents of exactly --seq-length tokens (255 bytes and the end-of-document token): every
    HDP micro-batch is then one whole document, however many ranks share the step."""
    text = "".join(path.read_text() for path in sorted((ROOT / "megatron_bytescale").rglob("*.py")))
    text = "".join(c for c in text if 32 <= ord(c) < 127 or c == "\n")
    folder = work / "one_length"
    folder.mkdir()
    for i in range(48):
        (folder / f"doc{i:03d}.txt").write_text(text[i * 255 : (i + 1) * 255])
    return prepare_text_dataset(work / "one_length_corpus", sorted(folder.glob("*.txt")), timeout=120)


# The mixture of experts the MoE tests train: the tiny MoE with both of Megatron's per-micro-batch
# load-balancing losses, the z-loss, a sigmoid router with expert bias and a shared expert (the
# DeepSeek-V3 kind of router), on the all-to-all dispatcher
MOE = (
    "--num-layers",  # 4 (tiny-moe has 2): the pipelined runs hold one layer per virtual stage
    "4",
    "--hidden-dropout",
    "0",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-router-load-balancing-type",
    "aux_loss",
    "seq_aux_loss",
    "--moe-aux-loss-coeff",
    "1e-2",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-shared-expert-intermediate-size",
    "32",
)
EP2 = ("--expert-model-parallel-size", "2")
OVERLAP = ("--overlap-grad-reduce", "--overlap-param-gather")
MOE_STEP_TOKENS = 3 * 256  # three documents a step: on 4 ranks in 2 EP groups, one slot is a filler


def _moe_common(data_prefix):
    return dict(
        MODEL="tiny-moe", GLOBAL_BATCH_SIZE=8, TRAIN_ITERS=3, DATA_PATH=data_prefix, HDP_STEP_TOKENS=MOE_STEP_TOKENS
    )


@pytest.fixture(scope="module")
def moe_runs(one_length_data, work):
    """EP=2 on 4 ranks (two EP groups; full recompute, overlapped distributed optimizer) and on
    2 ranks (one group), 3 iterations; the 2-rank run saves the model the pipeline test loads."""
    recompute = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    common = _moe_common(one_length_data)

    def run(args):
        nproc, extra, variables = args
        return train(Path(MEGATRON_LM_DIR), *MOE, *EP2, *extra, **common, **variables, NPROC=nproc).check()

    with ThreadPoolExecutor(2) as pool:  # mostly start-up: overlap them
        four, two = pool.map(
            run,
            (
                (4, (*recompute, *OVERLAP), {}),
                (2, ("--ckpt-format", "torch_dist"), dict(SAVE_DIR=work / "ckpt_moe", SAVE_INTERVAL=3)),
            ),
        )
    return four, two


def _filler_slots(data_prefix, world: int, pipeline_stages: int = 1) -> list[list[int]]:
    """The micro-batch token counts of each HDP rank in the MoE runs' first step, planned here
    as the ranks plan it (the same flags through the launcher's parser and validate_hdp_args)."""
    from megatron_bytescale.data.local_loader import LocalDataLoader
    from megatron_bytescale.megatron import preflight
    from megatron_bytescale.megatron.arguments import cost_model_from_args, planner_config_from_args
    from megatron_bytescale.planner.specs import read_args_file

    flags = read_args_file(str(ROOT / "configs/models/tiny-moe.args")) + [
        *MOE, *EP2, "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--calculate-per-token-loss", "--attention-dropout", "0.0", "--data-path", data_prefix, "--eval-iters", "0",
        "--eval-interval", "3", "--train-iters", "3", "--hybrid-data-parallel", "--hdp-token-capacity", "256",
        "--hdp-step-tokens", str(MOE_STEP_TOKENS), "--hdp-hardware", "cpu", "--tokenizer-type", "NullTokenizer",
    ]  # fmt: skip
    if pipeline_stages > 1:
        flags += ["--pipeline-model-parallel-size", str(pipeline_stages)]
    args = preflight.check(flags, world * pipeline_stages, Path(MEGATRON_LM_DIR) / "pretrain_gpt.py")
    loader = LocalDataLoader(
        data_prefix, planner_config_from_args(args), step_tokens=args.hdp_step_tokens, context_length=256,
        seed=args.seed, rank=0, cost=cost_model_from_args(args), vocab_size=512, plan_ahead=0,
    )  # fmt: skip
    plan = loader.step_plan().plan
    loader.close()
    return [[mb.tokens for mb in plan.micro_batches(r)] for r in range(world)]


def test_expert_parallel_with_aux_losses_equals_fewer_hdp_ranks(moe_runs, one_length_data):
    """Expert parallelism EP=2 with Megatron's aux_loss and seq_aux_loss (and the z-loss), a
    sigmoid router with expert bias and a shared expert, full recompute and the overlapped
    distributed optimizer: 4 HDP ranks (two EP groups) against 2 (one group), 3 iterations, equal
    losses, gradient norms and load-balancing losses.

    The load-balancing losses are statistics of each micro-batch (Megatron defines them per
    micro-batch: its routing fractions and mean probabilities over the micro-batch's tokens);
    HDP's micro-batches are packs of whole documents up to the capacity, or a rank's share of a
    long one, not Megatron's fixed-length samples, so with documents of mixed lengths the
    statistic, and its gradient, differ from another packing's by design (the same documents
    grouped otherwise). Here every document is exactly --seq-length tokens, so every
    micro-batch is one whole document in both runs and the statistics must agree to rounding.
    Megatron logs each loss as the sum over the step's micro-batches divided by its micro-batch
    count at micro-batch size 1, --global-batch-size (8 here, for 3 documents a step): the
    same sum over the same micro-batches in both runs.

    On 4 ranks one EP group holds one document for two members: the other runs a padding-only
    filler to join the all-to-alls (checked on the plan below). Its router statistics divide by
    zero real tokens in megatron-core (NaN gradients from the first filler on, and a run that
    trains on NaN without the NaN check); megatron/moe_statistics.py defines them as 0."""
    four, two = moe_runs
    slots = _filler_slots(one_length_data, 4)
    assert any(0 in ranks for ranks in slots), slots  # a filler: a slot with no real token
    assert [0] in slots, slots  # and a rank whose only slot is one
    assert re.search(r"recompute_granularity \.+ full", four.log) and re.search(
        r"overlap_param_gather \.+ True", four.log
    )
    print(
        f"EP=2: HDP=4 {four.losses} {four.grad_norms} {four.router}; HDP=2 {two.losses} {two.grad_norms} {two.router}"
    )
    for i in (1, 2, 3):
        assert {"load_balancing_loss", "seq_load_balancing_loss"} <= set(four.router[i]), four.router
        values = [four.losses[i], four.grad_norms[i], *four.router[i].values()]
        assert all(math.isfinite(float(v)) for v in values), values
    _close(four, two, (1, 2, 3), "EP=2 x HDP=4 against EP=2 x HDP=2")


def test_moe_pipeline_parallel_hdp_equals_one_rank(moe_runs, one_length_data, work):
    """The same mixture of experts (both load-balancing losses, sigmoid router with expert bias,
    shared expert) with PP=2 x HDP=2 and the overlapped distributed optimizer, against one rank
    without PP: 3 iterations from the MoE reference run's weights (--finetune; EP=2 checkpoint
    read on EP=1), equal losses, gradient norms and load-balancing losses. Expert parallelism
    with pipelines is refused, so the experts are not split here.

    One document a step: one pipeline has no micro-batch. Its routers record zero losses
    (megatron/moe_statistics.py: record_idle_rank), so that Megatron's logging reduces them over
    the same groups on every rank (on core_v0.16 an idle rank hung the run at its first log line)."""
    common = dict(_moe_common(one_length_data), HDP_STEP_TOKENS=256, LOAD_DIR=work / "ckpt_moe")
    flags = (*MOE, "--ckpt-format", "torch_dist", "--finetune")

    def run(layout):
        pp, nproc, extra = layout
        return train(Path(MEGATRON_LM_DIR), *flags, *extra, **common, PP=pp, NPROC=nproc).check()

    with ThreadPoolExecutor(2) as pool:
        pipelined, one = pool.map(run, ((2, 4, OVERLAP), (1, 1, ())))
    assert "pipeline model parallel with size 2" in pipelined.log and "successfully loaded checkpoint" in pipelined.log
    print(f"MoE PP=2 x HDP=2 {pipelined.losses} {pipelined.router}; one rank {one.losses} {one.router}")
    _close(pipelined, one, (1, 2, 3), "MoE PP=2 x HDP=2 against one rank")


def test_expert_parallel_with_pipelines_and_virtual_stages_equals_one_rank(moe_runs, one_length_data, work):
    """Expert parallelism with pipelines: PP=2 x EP=2 x HDP=2 and PP=2 x V=2 x EP=2 x HDP=2 (the
    MoE above: both load-balancing losses, z-loss, sigmoid router with expert bias, shared
    expert; the overlapped distributed optimizer), against one rank without PP or EP: 3
    iterations from the MoE reference run's weights (--finetune), equal losses, gradient norms
    and load-balancing losses.

    Three documents a step on two pipelines of one EP group: one pipeline runs two, the other
    one and a padding-only filler, so that at each stage the two members' all-to-alls pair
    slot by slot (planner/expert/pipelines.py: one slot numbering over all pipelines, the
    default 1F1B or interleaved order on every member). Each document is --seq-length tokens,
    so every micro-batch is one whole document in every run and the per-micro-batch router
    statistics agree (see the EP test above)."""
    common = dict(_moe_common(one_length_data), LOAD_DIR=work / "ckpt_moe")
    flags = (*MOE, "--ckpt-format", "torch_dist", "--finetune")
    virtual = ("--num-layers-per-virtual-pipeline-stage", "1")

    def run(layout):
        pp, nproc, extra = layout
        return train(Path(MEGATRON_LM_DIR), *flags, *extra, **common, PP=pp, NPROC=nproc).check()

    with ThreadPoolExecutor(3) as pool:
        pipelined, interleaved, one = pool.map(
            run, ((2, 4, (*EP2, *OVERLAP)), (2, 4, (*EP2, *OVERLAP, *virtual)), (1, 1, ()))
        )
    slots = _filler_slots(one_length_data, 2, pipeline_stages=2)
    assert sorted(map(len, slots)) == [2, 2] and 0 in slots[0] + slots[1], slots  # lock-step slots, a filler
    for run_ in (pipelined, interleaved):
        assert "pipeline model parallel with size 2" in run_.log and "successfully loaded checkpoint" in run_.log
        assert re.search(r"expert_model_parallel_size \.+ 2", run_.log)
    assert re.search(r"virtual_pipeline_model_parallel_size \.+ 2", interleaved.log)
    print(f"MoE PP=2 x EP=2 {pipelined.losses} {pipelined.router}; V=2 {interleaved.losses}; one {one.losses}")
    _close(pipelined, one, (1, 2, 3), "MoE PP=2 x EP=2 x HDP=2 against one rank")
    _close(interleaved, one, (1, 2, 3), "MoE PP=2 x V=2 x EP=2 x HDP=2 against one rank")


def test_overlapped_distributed_optimizer_and_pipelines_equal_one_rank(patched_run, patched_tree, data, work):
    """The patched pretrain_gpt.py with --pipeline-model-parallel-size 2 (train_local.sh's PP=2:
    PP=2 x HDP=2, 4 processes, --hdp-balance pp by default) against one rank without PP, same global batches,
    losses and gradient norms of 3 iterations. Word embeddings tied to the output layer: the last
    stage holds a copy, and Megatron's finalize_model_grads sums its gradient with the first
    stage's over the embedding group (measured: without that sum iteration 2's loss is off by
    4e-4). Megatron seeds initialisation per pipeline stage, so both runs start from the same
    weights: the 4-rank run's checkpoint (--finetune: the model only, fresh optimizer, iteration 0).
    The same with virtual pipeline stages (PP=2 x V=2 x HDP=2, ``--num-layers-per-virtual-pipeline-stage
    1``: device 0 holds layers 1 and 3, device 1 layers 2 and 4; the tied copies sit in chunk 0
    of device 0 and chunk 1 of device 1).

    The pipelines use the distributed optimizer (every run does) with --overlap-grad-reduce and
    --overlap-param-gather: Megatron's loop turns the parameter all-gathers' forward pre-hooks off
    for iteration 1 and on from iteration 2, and the HDP step dispatches each chunk's all-gathers
    itself (runtime/grad_sync.py). With --overlap-param-gather-with-optimizer-step the optimizer
    step dispatches the first chunk's: Megatron allows it with virtual stages only and not with
    distributed checkpoints, which the torch_dist checkpoint above is, so that run is compared with
    the same virtual stages without the overlapped flags, both from Megatron's initialisation."""
    model = work / "tiny-tied.args"
    model.write_text(
        "".join(
            line
            for line in (ROOT / "configs/models/tiny.args").read_text().splitlines(True)
            if "--untie-embeddings-and-output-weights" not in line
        )
    )
    common = dict(MODEL=model, GLOBAL_BATCH_SIZE=8, TRAIN_ITERS=3, DATA_PATH=data["train"])
    loaded = ("--hidden-dropout", "0", "--ckpt-format", "torch_dist", "--finetune")
    fresh = ("--hidden-dropout", "0", "--ckpt-format", "torch")
    virtual = ("--num-layers-per-virtual-pipeline-stage", "1")

    def run(layout):
        pp, nproc, flags, variables = layout
        return train(patched_tree, *flags, **common, **variables, PP=pp, NPROC=nproc).check()

    from_checkpoint = dict(LOAD_DIR=work / "ckpt_dist")
    layouts = {
        "PP=2 x HDP=2": (2, 4, (*loaded, *OVERLAP), from_checkpoint),
        "PP=2 x V=2 x HDP=2": (2, 4, (*loaded, *virtual, *OVERLAP), from_checkpoint),
        "one rank": (1, 1, loaded, from_checkpoint),
        "V=2, gathers in the optimizer step": (
            2,
            4,
            (*fresh, *virtual, *OVERLAP, "--overlap-param-gather-with-optimizer-step"),
            {},
        ),
        "V=2, no overlapped flags": (2, 4, (*fresh, *virtual), {}),
    }
    with ThreadPoolExecutor(len(layouts)) as pool:  # mostly start-up: overlap them
        runs = dict(zip(layouts, pool.map(run, layouts.values())))
    one = runs["one rank"]
    pipelined, interleaved = runs["PP=2 x HDP=2"], runs["PP=2 x V=2 x HDP=2"]
    in_step, plain = runs["V=2, gathers in the optimizer step"], runs["V=2, no overlapped flags"]
    assert "pipeline model parallel with size 2" in pipelined.log and "successfully loaded checkpoint" in pipelined.log
    assert re.search(r"untie_embeddings_and_output_weights \.+ False", pipelined.log)
    assert re.search(r"virtual_pipeline_model_parallel_size \.+ None", pipelined.log)
    for run_ in (interleaved, in_step, plain):
        assert re.search(r"virtual_pipeline_model_parallel_size \.+ 2", run_.log), run_.summary()
    assert re.search(r"overlap_param_gather_with_optimizer_step \.+ True", in_step.log)
    assert re.search(r"overlap_param_gather \.+ False", plain.log)
    for name, run_, reference in (
        ("PP=2 x HDP=2", pipelined, one),
        ("PP=2 x V=2 x HDP=2", interleaved, one),
        ("PP=2 x V=2 x HDP=2, first chunk's gathers in the optimizer step", in_step, plain),
    ):
        assert re.search(r"overlap_param_gather \.+ True", run_.log), name
        print(f"{name}: {run_.losses} {run_.grad_norms}; reference {reference.losses} {reference.grad_norms}")
        _close(run_, reference, (1, 2, 3), name)


def _drop(flag):
    def edit(flags):
        i = flags.index(flag)
        return flags[:i] + flags[i + 2 :]

    return edit


def _tp(size):
    def edit(flags):
        i = flags.index("--tensor-model-parallel-size")
        return flags[: i + 1] + [str(size)] + flags[i + 2 :]

    return edit


# case: (script variables, edit of the script's flags for a hand-written launch (None: the
# script refuses it itself), world size, the text the one error line must hold)
WRONG_LAUNCHES = {
    "world size not divisible by TP (script)": (dict(TP=2, NPROC=3), None, 3, "does not divide by TP=2"),
    "world size not divisible by TP": (dict(), _tp(2), 3, "world size 3 does not divide by"),
    "missing --hdp-token-capacity": (dict(), _drop("--hdp-token-capacity"), 1, "--hdp-token-capacity"),
    "--eval-iters 0 alone": (dict(), _drop("--eval-interval"), 1, "without --eval-interval"),
    "a missing data path": (dict(DATA_PATH="/nonexistent/corpus"), lambda f: f, 1, "/nonexistent/corpus"),
}


def test_wrong_launches_stop_with_one_line(data):
    """Each wrong launch, by the script or by hand through the launcher (one process, as
    ``python -m megatron_bytescale.launch``), exits with status 2 and one line naming the problem."""

    def launch(case):
        variables, edit, world, expected = WRONG_LAUNCHES[case]
        proc = dry_run(**{**dict(NPROC=1, DATA_PATH=data["train"], TRAIN_ITERS=2), **variables})
        if edit is None:
            return case, proc, expected
        assert proc.returncode == 0, proc.stderr
        flags = edit(launcher_flags(proc))
        return case, _direct(flags, WORLD_SIZE=world, RANK=0, LOCAL_RANK=0, DATA_PATH=data["train"]), expected

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(launch, WRONG_LAUNCHES))
    for case, proc, expected in results:
        assert proc.returncode == 2, (case, proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (case, proc.stderr[-3000:])
        errors = ERROR_LINE.findall(proc.stderr)
        assert errors and expected in errors[-1], (case, errors, proc.stderr[-2000:])


def dry_run(**variables) -> subprocess.CompletedProcess:
    """scripts/train_local.sh with DRY_RUN=1: the command line it would start is its last line."""
    return subprocess.run(
        ["bash", str(ROOT / "scripts/train_local.sh")],
        env=_environment(Path(MEGATRON_LM_DIR), DRY_RUN=1, **variables),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def launcher_flags(proc: subprocess.CompletedProcess) -> list[str]:
    """pretrain_gpt.py's flags in a dry run's command line (what follows the launcher and the script)."""
    argv = shlex.split(proc.stdout.strip().splitlines()[-1])
    return argv[argv.index("megatron_bytescale.launch") + 2 :]


def _direct(args: list[str], **variables) -> subprocess.CompletedProcess:
    variables.setdefault("PYTHONPATH", os.pathsep.join([MEGATRON_LM_DIR, str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "megatron_bytescale.launch", str(Path(MEGATRON_LM_DIR) / "pretrain_gpt.py"), *args],
        env=_environment(Path(MEGATRON_LM_DIR), **variables),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
    )
