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
MTP = ("--hidden-dropout", "0", "--mtp-num-layers", "2")
RUNS = {
    # name: (ranks, token capacity, flags)
    "latent ring, selective recompute": (4, 64, ("--hdp-mla-ring", "latent", "--recompute-activations")),
    "K/V ring, full recompute": (
        4,
        64,
        ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    ),
    "one rank": (1, 256, ()),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = prepare_text_dataset(
        tmp_path_factory.mktemp("mla") / "train", sorted((ROOT / "megatron_bytescale").rglob("*.py")), timeout=120
    )
    common = dict(MODEL="tiny-mla", GLOBAL_BATCH_SIZE=8, TRAIN_ITERS=3, DATA_PATH=data, SEQ_LENGTH=256)

    def run(name):
        ranks, capacity, flags = RUNS[name]
        return name, train(Path(MEGATRON_LM_DIR), *MTP, *flags, **common, NPROC=ranks, HDP_TOKEN_CAPACITY=capacity)

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
    carried = ring_bytes(hdp)
    print(f"{name}: ring bytes of rank 0 over 3 steps {carried}")
    assert set(carried) == ({"latent"} if "latent" in name else {"kv"}) and min(carried.values()) > 0
    assert not ring_bytes(one)  # one rank: no ring
