import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.sim.cluster import Cluster


def test_hdp_ranks_and_nodes():
    c = Cluster(1024, tp=2, pp=4, gpus_per_node=8)
    assert c.d_hdp == 128 and c.hdp_per_node == 4
    assert c.same_node(4, 7) and not c.same_node(3, 4)
    small = Cluster(4, gpus_per_node=8)  # under one node: everyone shares it
    assert small.hdp_per_node == 4 and small.same_node(0, 3)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        (dict(gpus=1000, tp=8, pp=2), "1000 GPUs do not divide by TP x PP = 8 x 2"),
        (dict(gpus=96, tp=3, pp=1), "TP=3 does not divide 8 GPUs per node"),
        (dict(gpus=24, tp=1, pp=2), "12 GPUs do not fill whole 8-GPU nodes"),
        (dict(gpus=0), "gpus must be a positive whole number"),
        (dict(gpus=8, tp=0), "tp must be a positive whole number"),
    ],
)
def test_bad_clusters_name_the_problem(kwargs, problem):
    with pytest.raises(ConfigError, match=problem):
        Cluster(**kwargs)
