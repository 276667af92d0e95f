"""Multi-latent attention and multi-token prediction through Megatron-LM's own ``pretrain_gpt.py``
(core_v0.16.1 or core_v0.19; CI runs this file against both) under HDP on CPU/gloo.

The tiny MLA model (``configs/models/tiny-mla.args``: query heads of 16 + 8 rotary dims,
values of 16, a 32-wide KV latent, YaRN RoPE) with two MTP depths, 3 iterations of Megatron's
loop with its distributed optimizer, documents cut at 256 tokens on ranks of capacity 64 (so
each long document is split over a ring of up to 4 members), against one rank of capacity 256
on the same global batches: the same losses and gradient norms

* with the latent ring (``--hdp-mla-ring latent``) and selective recompute of core attention;
* with the K/V ring (the default) and full recompute of every layer.

The step log names what each run's rings carried. Needs MEGATRON_LM_DIR; skipped without it.
"""

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_pretrain_gpt_cpu import train

from megatron_lm import MEGATRON_LM_DIR, ROOT, needs_tree, prepare_text_dataset

pytestmark = needs_tree

RING_BYTES = re.compile(r"ring bytes sent here: (.+)$", re.M)
MTP_LOSS = re.compile(r"iteration\s+(\d+)/.*?\| mtp_1 loss: (\S+) \| mtp_2 loss: (\S+) \|")


def mtp_losses(run) -> dict[int, tuple[float, float]]:
    """The logged loss of each MTP depth per iteration (megatron/mtp.py: per token of the step)."""
    return {int(i): (float(a), float(b)) for i, a, b in MTP_LOSS.findall(run.log)}


def assert_same_mtp_losses(run, reference):
    ours, theirs = mtp_losses(run), mtp_losses(reference)
    assert sorted(ours) == sorted(theirs) == [1, 2, 3], (ours, theirs)
    for i in ours:
        assert ours[i] == pytest.approx(theirs[i], rel=1e-5), (i, ours, theirs)


MTP = ("--hidden-dropout", "0", "--mtp-num-layers", "2")
RUNS = {
    # name: (ranks, token capacity, flags)
    "latent ring, selective recompute": (4, 64, ("--hdp-mla-ring", "latent", "--recompute-activations")),
    "K/V ring, full recompute": (
        4,
        64,
        ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    ),
    "one rank": (1, 256, ("--ckpt-format", "torch_dist")),  # saves the weights the pipelines start from
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("mla")


@pytest.fixture(scope="module")
def common(work):
    data = prepare_text_dataset(work / "train", sorted((ROOT / "megatron_bytescale").rglob("*.py")), timeout=120)
    return dict(MODEL="tiny-mla", GLOBAL_BATCH_SIZE=8, TRAIN_ITERS=3, DATA_PATH=data, SEQ_LENGTH=256)


@pytest.fixture(scope="module")
def runs(common, work):
    def run(name):
        ranks, capacity, flags = RUNS[name]
        saves = dict(SAVE_DIR=work / "ckpt", SAVE_INTERVAL=3) if name == "one rank" else {}
        return name, train(
            Path(MEGATRON_LM_DIR), *MTP, *flags, **common, **saves, NPROC=ranks, HDP_TOKEN_CAPACITY=capacity
        )

    with ThreadPoolExecutor(len(RUNS)) as pool:  # mostly start-up: overlap them
        return {name: r.check() for name, r in pool.map(run, RUNS)}


def ring_bytes(run) -> dict[str, int]:
    """What rank 0's rings sent, per transport, summed over the logged steps."""
    total: dict[str, int] = {}
    for line in RING_BYTES.findall(run.log):
        for part in line.split(", "):
            name, sent = part.rsplit(" ", 1)
            total[name] = total.get(name, 0) + int(sent.replace(",", ""))
    return total


@pytest.mark.parametrize("name", [n for n in RUNS if n != "one rank"])
def test_mla_and_mtp_under_hdp_equal_one_rank(runs, name):
    hdp, one = runs[name], runs["one rank"]
    for run in (hdp, one):
        assert re.search(r"multi_latent_attention \.+ True", run.log) and re.search(r"mtp_num_layers \.+ 2", run.log)
    assert sorted(hdp.losses) == sorted(one.losses) == [1, 2, 3], (hdp.summary(), one.summary())
    print(f"{name}: losses {hdp.losses}, grad norms {hdp.grad_norms}; one rank {one.losses}, {one.grad_norms}")
    for i in (1, 2, 3):  # Megatron prints 7 digits: fp32 summation orders differ in the last
        assert abs(float(hdp.losses[i]) - float(one.losses[i])) < 5e-6, (i, hdp.losses, one.losses)
        assert abs(float(hdp.grad_norms[i]) - float(one.grad_norms[i])) <= 1e-3, (i, hdp.grad_norms, one.grad_norms)
    assert_same_mtp_losses(hdp, one)  # the logged depth losses too: a ring share is not a micro-batch
    carried = ring_bytes(hdp)
    print(f"{name}: ring bytes of rank 0 over 3 steps {carried}")
    assert set(carried) == ({"latent"} if "latent" in name else {"kv"}) and min(carried.values()) > 0
    assert not ring_bytes(one)  # one rank: no ring


def test_mtp_with_pipelines_equals_one_rank(runs, common, work):
    """The same MLA model with two MTP depths on PP=2 x HDP=2 (the MTP layers on the last stage,
    rings of 2 members at capacity 128) against one rank, both from the one-rank run's
    weights (--finetune: Megatron seeds each pipeline stage's initialisation apart), 3
    iterations: the same losses and gradient norms."""
    load = dict(common, LOAD_DIR=work / "ckpt")
    flags = (*MTP, "--ckpt-format", "torch_dist", "--finetune")

    def run(layout):
        pp, ranks, capacity = layout
        return train(Path(MEGATRON_LM_DIR), *flags, **load, PP=pp, NPROC=ranks, HDP_TOKEN_CAPACITY=capacity).check()

    with ThreadPoolExecutor(2) as pool:
        pipelined, one = pool.map(run, ((2, 4, 128), (1, 1, 256)))
    assert "pipeline model parallel with size 2" in pipelined.log and "successfully loaded checkpoint" in pipelined.log
    assert re.search(r"mtp_num_layers \.+ 2", pipelined.log) and ring_bytes(pipelined)
    print(f"MTP PP=2 x HDP=2: losses {pipelined.losses}, grad norms {pipelined.grad_norms}; one rank {one.losses}")
    assert sorted(pipelined.losses) == sorted(one.losses) == [1, 2, 3], (pipelined.summary(), one.summary())
    for i in (1, 2, 3):
        assert abs(float(pipelined.losses[i]) - float(one.losses[i])) < 5e-6, (i, pipelined.losses, one.losses)
        assert abs(float(pipelined.grad_norms[i]) - float(one.grad_norms[i])) <= 1e-3, (i, pipelined.grad_norms)
    assert_same_mtp_losses(pipelined, one)
