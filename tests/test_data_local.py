"""The local loader: tokens at the planned ranges, per-rank reads, resume, and agreement
between ranks running as separate gloo processes."""

import hashlib
import json

import numpy as np
import pytest
import torch.distributed as dist

from megatron_bytescale.data.indexed import DocumentDataset
from megatron_bytescale.data.local_loader import LocalDataLoader
from megatron_bytescale.data.planning import SamplesDigest, rank_token_ranges
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.local_world import run_local_world
from megatron_bytescale.planner.planner import PlannerConfig

from data_support import build_corpus, simple_plan_fn

RANKS, CAPACITY = 4, 2048
SETTINGS = dict(step_tokens=3 * RANKS * CAPACITY, context_length=RANKS * CAPACITY, seed=11)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"))


def make_loader(corpus, **kw):
    """The shipped default: the HDP planner with the default (tiny model, H200) cost model."""
    return LocalDataLoader(corpus, PlannerConfig(num_ranks=RANKS, capacity=CAPACITY), **{**SETTINGS, **kw})


def test_delivered_tokens_are_the_documents_tokens_at_the_planned_ranges(corpus):
    loader = make_loader(corpus)
    ds = DocumentDataset(corpus)
    for _ in range(4):
        sp = loader.step_plan()
        sp.plan.validate()
        assert sp.plan.meta["strategy"] == "hdp-balanced"
        seen = {i: np.zeros(s.length, dtype=int) for i, s in enumerate(sp.samples)}
        for rank in range(RANKS):
            batch = loader.batch(rank)
            assert batch.plan is sp.plan and len(batch.micro_batches) == len(sp.plan.micro_batches(rank))
            for mbd in batch.micro_batches:
                at = 0
                for piece in mbd.micro_batch.pieces:
                    sample = sp.samples[piece.seq_id]
                    doc = ds.read(sample.doc_id, sample.start, sample.end).astype(np.int64)
                    for a, b in piece.ranges:
                        n = b - a
                        assert mbd.tokens[at : at + n].tolist() == doc[a:b].tolist()
                        assert mbd.positions[at : at + n].tolist() == list(range(a, b))
                        labels = doc[a + 1 : b + 1]
                        assert mbd.labels[at : at + len(labels)].tolist() == labels.tolist()
                        assert mbd.loss_mask[at + n - 1].item() == (0.0 if b == sample.length else 1.0)
                        seen[piece.seq_id][a:b] += 1
                        at += n
                assert at == mbd.num_tokens
        assert all((c == 1).all() for c in seen.values())  # every sample token delivered once
        loader.advance()


def test_each_rank_reads_only_its_own_ranges(corpus):
    loader = make_loader(corpus)
    sp = loader.step_plan()
    total = sum(s.length for s in sp.samples) * 2
    reads = []
    for rank in range(RANKS):
        batch = loader.batch(rank)
        expected = sum(stop - start for _, start, stop in rank_token_ranges(sp, rank)) * 2
        assert batch.bytes_read == expected
        reads.append(batch.bytes_read)
    assert max(reads) < total / 2  # far less than every rank reading the whole step
    assert sum(reads) < 1.1 * total


def _digests(loader, steps, ranks=RANKS):
    out = []
    for _ in range(steps):
        d = SamplesDigest()
        for rank in range(ranks):
            d.add(loader.batch(rank))
        out.append(d.hexdigest())
        loader.advance()
    return out


def test_resume_from_a_saved_state_continues_with_the_identical_sample_order(corpus):
    straight = _digests(make_loader(corpus), 9)
    first = make_loader(corpus)
    head = _digests(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = make_loader(corpus)
    resumed.load_state_dict(state)
    assert head + _digests(resumed, 5) == straight
    assert len(set(straight)) == len(straight)  # steps differ: the comparison can fail


def test_the_planning_function_is_a_parameter(corpus):
    loader = LocalDataLoader(corpus, plan_fn=simple_plan_fn(RANKS, CAPACITY), rank=1, **SETTINGS)
    batch = loader.next_step()
    assert batch.plan.meta["strategy"] == "simple" and batch.rank == 1
    batch.check()  # the runtime's StepBatch contract
    batch.plan.validate()


def test_a_different_seed_gives_different_samples(corpus):
    assert _digests(make_loader(corpus), 2) != _digests(make_loader(corpus, seed=12), 2)


def test_state_of_another_loader_is_refused(corpus):
    state = make_loader(corpus).state_dict()
    with pytest.raises(ConfigError, match="context_length: saved 8192, now 4096"):
        make_loader(corpus, context_length=4096).load_state_dict(state)


def test_loader_errors(corpus, tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        make_loader(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="PlannerConfig"):
        LocalDataLoader(corpus, **SETTINGS)
    with pytest.raises(ConfigError, match="which rank"):
        make_loader(corpus).next_step()


def _plan_key(plan):
    return hashlib.sha256(json.dumps([plan.seq_lens, plan.to_dict()["ranks"]]).encode()).hexdigest()


WORLD_SETTINGS = dict(step_tokens=3 * 2 * CAPACITY, context_length=2 * CAPACITY, seed=11)


def _rank_loop(rank, world_size, corpus, steps):
    config = PlannerConfig(num_ranks=world_size, capacity=CAPACITY)
    loader = LocalDataLoader(corpus, config, rank=rank, **WORLD_SETTINGS)
    out = []
    for batch in loader:
        d = SamplesDigest()
        d.add(batch)
        keys = [None] * world_size
        dist.all_gather_object(keys, _plan_key(batch.plan))
        out.append((keys, d.hexdigest()))
        if len(out) == steps:
            return out


def test_ranks_in_separate_processes_compute_the_same_plans_and_read_their_shards(corpus):
    world = 2
    results = run_local_world(_rank_loop, world, corpus, 3, timeout_s=120)
    reference = LocalDataLoader(corpus, PlannerConfig(num_ranks=world, capacity=CAPACITY), **WORLD_SETTINGS)
    for step in range(3):
        keys = results[0][step][0]
        assert len(set(keys)) == 1 and keys == results[1][step][0]
        assert keys[0] == _plan_key(reference.step_plan().plan)
        for rank in range(world):
            d = SamplesDigest()
            d.add(reference.batch(rank))
            assert results[rank][step][1] == d.hexdigest()
        reference.advance()
