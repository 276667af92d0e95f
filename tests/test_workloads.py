import numpy as np
import pytest

from megatron_bytescale.data.workloads import (
    Workload,
    check_targets,
    lengths_from_file,
    read_lengths_file,
    sample_lengths,
)
from megatron_bytescale.errors import ConfigError

K, M = 1024, 1024 * 1024


@pytest.mark.parametrize("name", ["byted", "github"])
def test_generated_batches_reproduce_the_design_statistics(name):
    # ~1-2M samples: the 2M point mass (0.05% of Byted samples) is then seen ~1000 times,
    # so each target's stated tolerance is several standard deviations wide
    lengths = sample_lengths(name, 16 * 1024 * M, 2 * M, rng=0)
    workload = Workload.load(name)
    assert len(workload.targets) >= 2
    for target, measured, ok in check_targets(workload, lengths):
        assert ok, f"{name}: {target.describe()} is {measured:.4f}, design says {target.value} +- {target.tol}"


def test_byted_targets_are_the_designs_numbers():
    # guard against the file's targets drifting from the design's statistics
    stated = {(t.kind, t.min, t.above, t.max): t.value for t in Workload.load("byted").targets}
    assert stated[("samples", None, None, 4 * K)] == 0.80
    assert stated[("tokens", 128 * K, None, None)] == 0.443
    assert stated[("tokens", None, 256 * K, None)] == 0.37
    assert stated[("tokens", 2 * M, None, None)] == 0.121
    assert stated[("samples", 128 * K, None, None)] == 0.01


def test_batches_are_full_cut_to_the_context_and_deterministic():
    a = sample_lengths("byted", 8 * M, 256 * K, rng=3)
    b = sample_lengths("byted", 8 * M, 256 * K, rng=np.random.default_rng(3))
    c = sample_lengths("byted", 8 * M, 256 * K, rng=4)
    assert a == b and a != c
    assert sum(a) == 8 * M
    assert max(a) <= 256 * K and min(a) >= 1
    assert all(isinstance(s, int) for s in a)


def test_a_batch_smaller_than_one_sequence_is_one_cut_sequence():
    assert sample_lengths("github", 100, 2 * M, rng=0) == [100]


def test_unknown_dataset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown dataset 'wiki'.*byted.*github"):
        sample_lengths("wiki", 1000, 1000, rng=0)


def test_lengths_file_is_resampled_until_the_batch_is_full(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# one length per line\n100\n\n5000  # long one\n300\n")
    pool = read_lengths_file(path)
    assert list(pool) == [100, 5000, 300]
    batch = lengths_from_file(pool, 20000, 4096, rng=0)
    assert sum(batch) == 20000
    assert set(batch[:-1]) <= {100, 4096, 300}  # 5000 cut to the context; the last one cut to fit
    assert 4096 in batch


@pytest.mark.parametrize(
    "text, problem",
    [
        ("100\nabc\n", "line 2: 'abc' is not a whole number"),
        ("1\n0\n", "line 2: length 0 must be positive"),
        ("# nothing\n", "holds no lengths"),
    ],
)
def test_malformed_lengths_file_names_file_and_line(tmp_path, text, problem):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}.*{problem}"):
        read_lengths_file(path)


def test_missing_lengths_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_lengths_file(tmp_path / "nope.txt")


def test_malformed_workload_file(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("segments:\n  - {lo: 1K, hi: 2K, token_share: 0.5}\n")
    with pytest.raises(ConfigError, match="token shares sum to 0.5000"):
        Workload.load(str(path))
    path.write_text("segments:\n  - {lo: 1K, token_share: 1}\n")
    with pytest.raises(ConfigError, match="malformed.*'hi'"):
        Workload.load(str(path))
