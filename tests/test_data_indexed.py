"""Megatron indexed datasets: round trip through megatron-core, and every malformed input
refused with a ConfigError that names the file and the fix."""

import json
import shutil
import struct

import numpy as np
import pytest
import torch

from megatron_bytescale import cli
from megatron_bytescale.data.corpus import SourceDocument, site_packages_documents
from megatron_bytescale.data.indexed import DocumentDataset, write_indexed_dataset
from megatron_bytescale.errors import ConfigError

from data_support import SMALL_PACKAGES, build_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"))


def _docs(*texts):
    return [SourceDocument(f"d{i}", lambda t=t: iter([c.encode() for c in t])) for i, t in enumerate(texts)]


def test_documents_round_trip_with_eod_and_boundaries(corpus):
    ds = DocumentDataset(corpus, vocab_size=512)
    sources = site_packages_documents(packages=SMALL_PACKAGES)
    assert len(ds) == len(sources)
    assert ds.document_names == [d.name for d in sources]
    for doc_id, src in enumerate(sources):
        expected = np.frombuffer(b"".join(src.chunks()), dtype=np.uint8)
        assert ds.lengths[doc_id] == expected.size + 1
        tokens = ds.read(doc_id, 0, int(ds.lengths[doc_id]))
        assert np.array_equal(tokens[:-1], expected) and tokens[-1] == 256
    # a range inside a document reads exactly those tokens, and counts its bytes
    before = ds.bytes_read
    mid = ds.read(1, 1000, 1100)
    assert np.array_equal(mid, ds.read(1, 0, 2000)[1000:1100])
    assert ds.bytes_read - before == 100 * ds.itemsize + 2000 * ds.itemsize


def test_megatron_core_reads_our_files_as_documents_of_file_items(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    mds = IndexedDataset(corpus)
    ours = DocumentDataset(corpus)
    assert mds.index.dtype == np.uint16
    doc_idx = mds.document_indices
    assert len(doc_idx) - 1 == len(ours)
    for d in range(len(ours)):
        items = mds[int(doc_idx[d]) : int(doc_idx[d + 1])]
        assert len(items) > 1  # one item per source file
        whole = np.concatenate(items)
        assert np.array_equal(whole, ours.read(d, 0, int(ours.lengths[d])))
        assert items[0][:4].tolist() == list(b"==> ")  # each item starts with its file header


def test_empty_documents_are_skipped_on_write(tmp_path):
    info = write_indexed_dataset(tmp_path / "x", _docs(["ab"], [], ["", "c", "de"]))
    assert (info.num_documents, info.skipped_empty) == (2, 1)
    ds = DocumentDataset(tmp_path / "x")
    assert ds.lengths.tolist() == [3, 4]
    assert ds.read(1, 0, 4).tolist() == [ord("c"), ord("d"), ord("e"), 256]


def test_writing_nothing_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no document with text"):
        write_indexed_dataset(tmp_path / "x", _docs([], [""]))
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()


def test_prefix_may_be_given_with_an_extension(corpus):
    assert len(DocumentDataset(corpus + ".bin")) == len(DocumentDataset(corpus + ".idx"))


# ------------------------------------------------------------------ malformed inputs
@pytest.fixture
def small(tmp_path):
    write_indexed_dataset(tmp_path / "s", _docs(["hello ", "world"], ["second doc"]))
    return str(tmp_path / "s")


def test_missing_files(small, tmp_path):
    with pytest.raises(ConfigError, match=r"missing .*nope\.idx and .*nope\.bin.*prepare-data"):
        DocumentDataset(tmp_path / "nope")
    (tmp_path / "s.bin").unlink()
    with pytest.raises(ConfigError, match=r"missing .*s\.bin"):
        DocumentDataset(small)


def test_bad_header(small):
    with open(small + ".idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    with pytest.raises(ConfigError, match=r"s\.idx is not a Megatron indexed-dataset index"):
        DocumentDataset(small)


def test_not_an_index_at_all(small):
    with open(small + ".idx", "wb") as f:
        f.write(b"{}")
    with pytest.raises(ConfigError, match="bad or short header"):
        DocumentDataset(small)


def test_truncated_index(small):
    data = open(small + ".idx", "rb").read()
    open(small + ".idx", "wb").write(data[:-5])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        DocumentDataset(small)


def test_bin_that_does_not_match_the_index(small):
    data = open(small + ".bin", "rb").read()
    open(small + ".bin", "wb").write(data[:-2])
    with pytest.raises(ConfigError, match=r"s\.bin: .* bytes, but s\.idx describes .* do not belong together"):
        DocumentDataset(small)


def test_bin_and_idx_from_different_builds(small, tmp_path):
    write_indexed_dataset(tmp_path / "other", _docs(["a much longer document than before"]))
    shutil.copy(tmp_path / "other.bin", small + ".bin")
    with pytest.raises(ConfigError, match="do not belong together"):
        DocumentDataset(small)


def test_a_bin_of_the_same_size_from_another_build_is_refused(small, tmp_path):
    # the index describes sizes only: the .bin's sampled content, recorded by prepare-data, tells
    write_indexed_dataset(tmp_path / "o", _docs(["jello ", "world"], ["second dog"]))  # same lengths
    assert (tmp_path / "o.bin").stat().st_size == open(small + ".bin", "rb").seek(0, 2)
    shutil.copy(tmp_path / "o.bin", small + ".bin")
    with pytest.raises(ConfigError) as error:
        DocumentDataset(small)
    assert str(error.value) == (
        f"{small}.bin: its content does not match s.idx (a sample of its bytes differs from the one "
        "s.bytescale.json recorded when the dataset was built): the .bin comes from another build or was "
        "overwritten; rebuild it (Megatron's tools/preprocess_data.py, or `bytescale prepare-data --output PREFIX ...`)"
    )
    meta = json.loads(open(small + ".bytescale.json").read())
    del meta["bin_sample_sha256"]  # a sidecar from before the digest: nothing to compare, it opens
    open(small + ".bytescale.json", "w").write(json.dumps(meta))
    assert DocumentDataset(small).read(0, 0, 1).tolist() == [ord("j")]


def test_a_datasets_identity_is_its_content_not_its_place(small, tmp_path):
    from megatron_bytescale.data.indexed import dataset_identity

    for suffix in (".bin", ".idx"):
        shutil.copy(small + suffix, tmp_path / f"moved{suffix}")
    assert dataset_identity(tmp_path / "moved") == dataset_identity(small)
    write_indexed_dataset(tmp_path / "o", _docs(["jello ", "world"], ["second dog"]))
    other = dataset_identity(tmp_path / "o")
    assert other["index_sha256"] == dataset_identity(small)["index_sha256"]  # the same lengths
    assert other["bin_sample_sha256"] != dataset_identity(small)["bin_sample_sha256"]


def test_float_token_dtype(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(tmp_path / "f.bin"), dtype=np.float32)
    b.add_item(torch.tensor([1.0, 2.0]))
    b.end_document()
    b.finalize(str(tmp_path / "f.idx"))
    with pytest.raises(ConfigError, match="stored as float32, not integers"):
        DocumentDataset(tmp_path / "f")


def test_empty_document_in_a_foreign_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(tmp_path / "e.bin"), dtype=np.uint16)
    b.add_item(torch.tensor([5, 6]))
    b.end_document()
    b.end_document()  # a document with no items
    b.finalize(str(tmp_path / "e.idx"))
    with pytest.raises(ConfigError, match=r"1 empty documents \(first: document 1\).*skips empty documents"):
        DocumentDataset(tmp_path / "e")


def test_vocab_mismatch_from_the_sidecar(small):
    with pytest.raises(ConfigError, match="vocabulary of 512 .* model's vocab size is 256"):
        DocumentDataset(small, vocab_size=256)


def test_vocab_mismatch_found_on_read_without_a_sidecar(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(tmp_path / "v.bin"), dtype=np.uint16)
    b.add_item(torch.tensor([1, 2, 3000, 4]))
    b.end_document()
    b.finalize(str(tmp_path / "v.idx"))
    ds = DocumentDataset(tmp_path / "v", vocab_size=512)
    assert ds.read(0, 0, 2).tolist() == [1, 2]
    with pytest.raises(ConfigError, match="token id 3000, outside the model's vocab size 512"):
        ds.read(0, 0, 4)


def test_sidecar_from_another_build(small, tmp_path):
    meta = json.loads(open(small + ".bytescale.json").read())
    meta["num_tokens"] += 1
    open(small + ".bytescale.json", "w").write(json.dumps(meta))
    with pytest.raises(ConfigError, match="come from different builds"):
        DocumentDataset(small)


def test_out_of_range_reads(small):
    ds = DocumentDataset(small)
    with pytest.raises(ConfigError, match="document 7 does not exist"):
        ds.read(7, 0, 1)
    with pytest.raises(ConfigError, match=r"range \[0, 99\) is outside document 0"):
        ds.read(0, 0, 99)


def test_unknown_dtype_code(small):
    with open(small + ".idx", "r+b") as f:
        f.seek(17)
        f.write(struct.pack("<B", 99))
    with pytest.raises(ConfigError, match="unknown token dtype code 99"):
        DocumentDataset(small)


# ------------------------------------------------------------------ prepare-data
def test_prepare_data_from_jsonl_and_text_lines(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ["alpha", "beta gamma", "δ"]) + "\n")
    assert cli.main(["prepare-data", "--jsonl", str(src), "--output", str(tmp_path / "j"), "--quiet"]) == 0
    ds = DocumentDataset(tmp_path / "j", vocab_size=512)
    assert ds.lengths.tolist() == [6, 11, 3]
    assert bytes(ds.read(2, 0, 2).astype(np.uint8)).decode() == "δ"
    assert "3 documents" in capsys.readouterr().out

    lines = tmp_path / "in.txt"
    lines.write_text("one\ntwo two\n")
    assert cli.main(["prepare-data", "--text-lines", str(lines), "--output", str(tmp_path / "t"), "--quiet"]) == 0
    assert DocumentDataset(tmp_path / "t").lengths.tolist() == [4, 8]


def test_prepare_data_from_site_packages_subset(tmp_path, capsys):
    out = tmp_path / "sp"
    argv = ["prepare-data", "--site-packages", "--packages", "iniconfig", "--output", str(out), "--quiet"]
    assert cli.main(argv) == 0
    ds = DocumentDataset(out)
    assert len(ds) == 1 and ds.document_names[0].startswith("iniconfig==")
    assert "NullTokenizer --vocab-size 512" in capsys.readouterr().out


def test_prepare_data_hint_can_be_pasted(tmp_path, capsys):
    """The printed next step names the vocabulary the dataset needs and a prefix a shell reads back."""
    import shlex

    lines = tmp_path / "in.txt"
    lines.write_text("one\ntwo two\n")
    prefix = tmp_path / "my data" / "corpus"
    prefix.parent.mkdir()
    assert cli.main(["prepare-data", "--text-lines", str(lines), "--output", str(prefix), "--quiet"]) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train with Megatron: ")][0]
    words = shlex.split(hint.split(": ", 1)[1])
    path, vocab = words[words.index("--data-path") + 1], int(words[words.index("--vocab-size") + 1])
    assert path == str(prefix)
    assert len(DocumentDataset(path, vocab_size=vocab)) == 2  # the loader accepts that vocabulary


def test_prepare_data_errors_are_reported_without_traceback(tmp_path, capsys):
    rc = cli.main(["prepare-data", "--jsonl", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")])
    assert rc == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    rc = cli.main(
        ["prepare-data", "--repos", str(tmp_path), "--packages", "iniconfig", "--output", str(tmp_path / "o")]
    )
    assert rc == 2
    assert "--packages only applies to --site-packages" in capsys.readouterr().err
