"""Blends, splits, mock data and SFT documents of the HDP loaders (data/blend.py, data/documents.py).

* a blend's token shares follow its weights within the bound data/blend.py proves, per step and
  over a run (property test); each part keeps its own epochs; the stream is deterministic and
  resumes exactly from a loader state;
* --split gives disjoint train/valid/test documents of each prefix, by Megatron's rounding, and
  our blend and split parsing agree with Megatron's own functions where a tree is at hand;
* empty documents (as tools/preprocess_data.py writes them) are skipped;
* mock documents are a pure function of the seed; SFT answers set the loss mask, wherever the
  plan cuts a conversation.
"""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_bytescale.data.blend import BlendPosition, BlendSampler, blend_from_list, parse_split, split_matrix
from megatron_bytescale.data.documents import (
    IGNORE_INDEX,
    MockDocuments,
    Part,
    SFTDocuments,
    StreamSpec,
    open_stream,
)
from megatron_bytescale.data.indexed import DocumentDataset
from megatron_bytescale.data.local_loader import LocalDataLoader
from megatron_bytescale.data.sampler import loader_state, restore_state
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.planner.contract import MicroBatch, Piece
from megatron_bytescale.planner.planner import PlannerConfig
from megatron_bytescale.runtime.batch import build_micro_batch_data

from megatron_lm import HAVE_TREE, MEGATRON_LM_DIR


def _run(sampler, steps, pos=None):
    pos = sampler.start() if pos is None else pos
    out = []
    for _ in range(steps):
        samples, pos = sampler.batch(pos)
        out.append(samples)
    return out, pos


def _shares(sampler, steps):
    """Tokens per part, per step."""
    batches, _ = _run(sampler, steps)
    per_step = np.zeros((steps, len(sampler.parts)), dtype=np.int64)
    for i, samples in enumerate(batches):
        for s in samples:
            per_step[i, sampler.part_of(s.doc_id)] += s.length
    return per_step


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.integers(64, 3000), min_size=1, max_size=30), min_size=2, max_size=4),
    st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
    st.integers(0, 2**31 - 1),
)
def test_blend_shares_stay_within_the_bound(parts, raw_weights, seed):
    context, step_tokens = 1024, 8192
    sampler = BlendSampler(parts, raw_weights[: len(parts)], step_tokens=step_tokens, context_length=context, seed=seed)
    per_step = _shares(sampler, 12)
    k, w = len(parts), np.array(sampler.weights)
    # per step: within k x the context length of the weight's share of the step's tokens
    assert np.all(np.abs(per_step - np.outer(per_step.sum(1), w)) <= k * context)
    # over the run: each part's deficit in [-L, (k - 1) L]
    cumulative = per_step.cumsum(0)
    deficit = np.outer(cumulative.sum(1), w) - cumulative
    assert np.all(deficit >= -context - 1e-6) and np.all(deficit <= (k - 1) * context + 1e-6)


def test_blend_share_figures(capsys):
    """The figures docs/cluster.md quotes: two parts 0.3 / 0.7 of documents cut at 8K, 64K-token
    steps, 200 steps; byted-like lengths."""
    from megatron_bytescale.data.workloads import Workload

    rng = np.random.default_rng(0)
    parts = [np.minimum(Workload.load(n).draw(4000, rng), 1 << 20) for n in ("byted", "github")]
    sampler = BlendSampler(parts, [0.3, 0.7], step_tokens=64 * 1024, context_length=8192, seed=1)
    per_step = _shares(sampler, 200)
    share = per_step[:, 0] / per_step.sum(1)
    run_share = per_step[:, 0].sum() / per_step.sum()
    with capsys.disabled():
        print(
            f"\nblend 0.3/0.7, 64K steps, 8K context: part-0 share per step {share.min():.4f}-{share.max():.4f} "
            f"(mean |error| {np.abs(share - 0.3).mean():.4f}), over 200 steps {run_share:.5f}"
        )
    assert np.abs(share - 0.3).max() <= 2 * 8192 / per_step.sum(1).min()
    assert abs(run_share - 0.3) <= 8192 / per_step.sum()


def test_each_part_has_its_own_epochs_and_the_stream_is_deterministic():
    small, large = [100] * 3, [100] * 40
    sampler = BlendSampler([small, large], [0.5, 0.5], step_tokens=400, context_length=100, seed=3)
    batches, end = _run(sampler, 10)
    ids = [s.doc_id for step in batches for s in step]
    # part 0 (3 documents) went through several epochs, each a permutation of its documents
    part0 = [d for d in ids if d < 3]
    assert len(part0) == 20 and all(sorted(part0[i : i + 3]) == [0, 1, 2] for i in range(0, 18, 3))
    assert end.parts[0].epoch == 6 and end.parts[1].epoch == 0
    again, _ = _run(BlendSampler([small, large], [0.5, 0.5], step_tokens=400, context_length=100, seed=3), 10)
    assert again == batches
    other, _ = _run(BlendSampler([small, large], [0.5, 0.5], step_tokens=400, context_length=100, seed=4), 10)
    assert other != batches


def test_blend_state_round_trips_and_refuses_another_blend():
    sampler = BlendSampler([[50] * 7, [70] * 9], [1, 3], step_tokens=300, context_length=64, seed=0)
    _, middle = _run(sampler, 4)
    state = json.loads(json.dumps(loader_state(4, middle, sampler.fingerprint())))
    step, pos = restore_state(state, sampler.fingerprint(), BlendPosition)
    assert step == 4 and pos == middle
    assert _run(sampler, 3, pos)[0] == _run(sampler, 7)[0][4:]
    other = BlendSampler([[50] * 7, [70] * 9], [1, 1], step_tokens=300, context_length=64, seed=0)
    with pytest.raises(ConfigError, match="blend_weights"):
        restore_state(state, other.fingerprint(), BlendPosition)


def test_megatron_default_weights_follow_the_parts_sizes():
    sampler = BlendSampler([[10] * 10, [10] * 30], None, step_tokens=100, context_length=10, seed=0)
    assert sampler.weights == (0.25, 0.75)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """An indexed dataset of 20 documents with document 7 empty (as preprocess_data.py writes one)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("blend") / "docs"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for d in range(20):
        n = 0 if d == 7 else 30 + 11 * d
        builder.add_document(torch.arange(n, dtype=torch.int32) % 500 + d, [n] if n else [])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_split_documents_are_disjoint_and_empty_ones_skipped(corpus):
    with pytest.raises(ConfigError, match="empty documents"):
        DocumentDataset(corpus)
    rows = split_matrix(parse_split("70,20,10"))
    streams = [open_stream(StreamSpec(n, (Part(corpus, None, r),)), context_length=64, seed=0) for n, r in
               zip(("train", "valid", "test"), rows)]  # fmt: skip
    ids = [set(s.doc_ids[0].tolist()) for s in streams]
    assert ids == [set(range(14)) - {7}, set(range(14, 18)), {18, 19}]
    # a split's loader reads that split's documents, by their own tokens
    config = PlannerConfig(num_ranks=1, capacity=64, balance="none")
    loader = LocalDataLoader(streams[1], config, step_tokens=128, context_length=64, seed=0, rank=0)
    batch = loader.next_step()
    firsts = [int(t) for mb in batch.micro_batches for t, p in zip(mb.tokens, mb.positions) if p == 0]
    # document d's token p is p + d (d < 20, p < 480): a window opens at a multiple of the context
    assert firsts and all(14 <= t % 64 <= 17 for t in firsts), firsts


@pytest.mark.skipif(not HAVE_TREE, reason="compares with Megatron-LM's own functions: set MEGATRON_LM_DIR")
def test_blend_and_split_parsing_agree_with_megatron():
    import sys

    sys.path.insert(0, MEGATRON_LM_DIR)
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.utils import get_blend_from_list

    for words in (["a"], ["a", "b", "c"], ["0.3", "a", "0.7", "b"], ["30", "a", "70", "b"], ["a", "b"]):
        prefixes, weights = get_blend_from_list(words)
        assert blend_from_list(words, "--data-path") == (prefixes, weights), words
    for text in ("969, 30, 1", "98,2,0", "100,0,0", "90,10", "1,1,1"):
        assert parse_split(text) == pytest.approx(parse_and_normalize_split(text)), text
        assert split_matrix(parse_split(text)) == convert_split_vector_to_split_matrix(parse_and_normalize_split(text))


def test_mock_documents_are_a_function_of_the_seed():
    def mock(seed, stream=0, spec="lognormal"):
        return MockDocuments(spec, count=500, context_length=4096, seed=seed, vocab_size=512, eod=511, stream=stream)

    a, b = mock(1), mock(1)
    assert np.array_equal(a.lengths, b.lengths) and not np.array_equal(a.lengths, mock(2).lengths)
    assert not np.array_equal(a.lengths, mock(1, stream=1).lengths)  # the valid split's own documents
    assert a.lengths.max() <= 4096 and a.lengths.min() >= 2
    doc = int(np.argmax(a.lengths))
    whole = a.read(doc, 0, int(a.lengths[doc]))
    assert np.array_equal(whole[10:20], b.read(doc, 10, 20)) and whole[-1] == 511 and whole[:-1].max() < 511
    for spec in ("byted", "github", "lognormal:mean=2K,sigma=1.1,min=1K,max=4K"):
        assert mock(0, spec=spec).lengths.min() >= 2
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        mock(0, spec="lognormal:mu=3")


def _fake_tokenize(conversation):
    """One token per word; system/user words are prompt (IGNORE_INDEX targets)."""
    tokens, targets = [], []
    for turn in conversation:
        ids = [len(w) + 10 for w in turn["content"].split()]
        tokens += ids
        targets += ids if turn["role"] == "assistant" else [IGNORE_INDEX] * len(ids)
    return tokens, targets


def test_sft_conversations_mask_prompt_labels_wherever_the_plan_cuts(tmp_path):
    lines = [
        {"messages": [{"role": "system", "content": "s s"}, {"role": "user", "content": "u u u"},
                      {"role": "assistant", "content": "a a a a"}, {"role": "system", "content": "t"},
                      {"role": "user", "content": "q"}, {"role": "assistant", "content": "b b"}]},
        {"messages": [{"role": "user", "content": "x " * 40}, {"role": "assistant", "content": "y " * 30}]},
    ]  # fmt: skip
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    docs = SFTDocuments(str(path), _fake_tokenize, context_length=64, pad_id=None, eod=99, append_eod=True)
    assert docs.lengths.tolist() == [10, 5, 64] and docs.num_elements == 2  # two conversations in line 1; cut at 64
    assert docs.element_documents(1, 2).tolist() == [2]
    # a conversation cut into zigzag ranges of a ring: each token's loss-mask entry is its label's
    piece = Piece(seq_id=0, seq_len=10, ranges=((0, 3), (7, 10)), ring=(0, 1))
    data = build_micro_batch_data(MicroBatch((piece,)), docs.read, docs.label_mask)
    answer = docs.label_mask(0, 0, 10)  # system 2 + user 3 prompt, answer 4, EOD appended (in the loss)
    assert answer.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert data.loss_mask.tolist() == [0, 0, 0, 1, 1, 0]  # labels of 0-2: prompt; 7, 8: answer; 9: none


def test_the_shadow_run_reads_the_blend_syntax(corpus):
    """`bytescale simulate --data-path 0.5 A 0.5 B` costs the blend's training batches."""
    from megatron_bytescale.data.workloads import training_batches

    steps, info = training_batches(["0.5", corpus, "0.5", corpus], 256, 64, 0)
    lengths = [n for _ in range(5) for n in next(steps)]
    assert info["documents"] == 38 and info["prefix"].startswith("0.5 x ") and max(lengths) <= 64
    single, one = training_batches(corpus, 256, 64, 0)
    assert one["documents"] == 19 and sum(next(single)) <= 256


def test_plan_plans_the_steps_training_on_a_blend_would_see(corpus, tmp_path, capsys):
    """`bytescale plan --data-path 0.5 A 0.5 B --global-batch-tokens T --steps 3`: the first
    three global batches of the blend's training stream, each planned; the plans hold exactly
    the lengths `training_batches` draws (the simulator's and the loader's stream)."""
    from megatron_bytescale.cli import main
    from megatron_bytescale.data.workloads import training_batches
    from megatron_bytescale.planner.contract import Plan

    out = tmp_path / "plans.jsonl"
    base = ["plan", "--model", "llama-7b", "--gpus", "8", "--capacity", "64", "--context", "64"]
    blend = ["--data-path", "0.5", corpus, "0.5", corpus]
    rc = main([*base, *blend, "--global-batch-tokens", "256", "--steps", "3", "--seed", "5", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and text.startswith("data: 0.5 x ") and "38 documents" in text, text
    assert text.rstrip().endswith("3 steps planned; plans written to " + str(out) + ", one JSON object per line")
    steps, _ = training_batches(["0.5", corpus, "0.5", corpus], 256, 64, 5)
    expected = [next(steps) for _ in range(3)]
    assert [list(Plan.from_json(line).validate().seq_lens) for line in out.read_text().splitlines()] == expected
    assert main([*base, *blend]) == 2  # the step size is needed
    assert "add --global-batch-tokens" in capsys.readouterr().err
