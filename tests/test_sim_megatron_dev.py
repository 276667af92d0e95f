"""The simulator's peer: Megatron's dynamic CP as its dev branch schedules it, imported from the
Megatron-LM dev tree named by ``BYTESCALE_MEGATRON_DEV`` (CI: ../shared/megatron-lm/dev_d48bd6b)."""

import os

import pytest
from test_sim_expert_parallel import ep_pp_config

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.sim.cluster import Cluster
from megatron_bytescale.sim.megatron_dcp_dev import DEV_TREE_ENV, dev_tree, megatron_dcp_dev_plan
from megatron_bytescale.sim.simulate import default_strategies, run

TREE = os.environ.get(DEV_TREE_ENV)
needs_tree = pytest.mark.skipif(not TREE, reason=f"set {DEV_TREE_ENV} to a Megatron-LM dev tree (dev_d48bd6b)")


@needs_tree
def test_groups_become_packed_micro_batches_on_their_cp_groups():
    # DefaultDynamicCPScheduler on 8 ranks of 8K: one group, [[0]*4, [3]*2, [1, 5, 4], [2]]
    lengths = [30000, 5000, 4000, 9000, 100, 2000]
    plan = megatron_dcp_dev_plan(lengths, Cluster(8), 8192, 2, dev_tree(TREE)).validate()
    assert [len(mbs) for mbs in plan.ranks] == [1] * 8
    rings = [mbs[0].ring for mbs in plan.ranks]
    assert rings[:4] == [(0, 1, 2, 3)] * 4 and rings[4:6] == [(4, 5)] * 2
    assert sorted(p.seq_id for p in plan.ranks[6][0].pieces) == [1, 4, 5] and plan.ranks[7][0].ring is None
    # with virtual stages the group count becomes a multiple of PP (microbatch_group_size_per_vp_stage)
    vpp = megatron_dcp_dev_plan(lengths, Cluster(16, pp=2), 8192, 1, dev_tree(TREE), virtual_stages=2).validate()
    assert len({len(mbs) for mbs in vpp.ranks}) == 1 and len(vpp.ranks[0]) % 2 == 0


@needs_tree
def test_dev_peer_runs_with_pipelines_virtual_stages_and_ep():
    assert "megatron-dcp-dev" in default_strategies(4, "qwen3-30b-a3b", TREE)
    report = run(ep_pp_config(strategies=("megatron-dcp-dev", "hdp-balanced"), megatron_dev=TREE), progress=False)
    assert not report.errors, report.errors
    dev = report.results()["megatron-dcp-dev"]
    assert dev["mean_step_time_s"] >= dev["lower_bound_s"] and dev["exposed_moe_a2a_s"] > 0


def test_a_tree_without_the_scheduler_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no megatron/core/datasets/data_schedule.py"):
        dev_tree(str(tmp_path))


def test_a_tree_whose_scheduler_cannot_import_is_one_line(tmp_path):
    from megatron_bytescale.sim.megatron_dcp_dev import dev_groups
    from megatron_bytescale.sim.static_cp import StrategyError

    package = tmp_path / "megatron" / "core" / "datasets"
    package.mkdir(parents=True)
    for d in (tmp_path / "megatron", tmp_path / "megatron" / "core", package):
        (d / "__init__.py").write_text("")
    (package / "data_schedule.py").write_text("raise ImportError('DefaultDynamicCPScheduler needs a newer torch')\n")
    with pytest.raises(StrategyError, match="failed starting: ImportError: DefaultDynamicCPScheduler needs a newer"):
        dev_groups([8, 4], 2, 8, dev_tree(str(tmp_path)), None)
