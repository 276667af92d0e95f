"""Corpus building and byte-level tokenization from real files on this machine."""

import json

import numpy as np
import pytest

from megatron_bytescale.data import corpus
from megatron_bytescale.data.tokenizer import ByteTokenizer
from megatron_bytescale.errors import ConfigError


def test_byte_tokenizer_matches_megatron_byte_level_tokenizer():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo → 世界'\n"
    ours = tok.encode(text)
    theirs = tok.megatron_tokenizer().text_to_ids(text)
    assert ours.tolist() == theirs
    assert tok.decode(np.append(ours, tok.eod)) == text
    assert tok.megatron_tokenizer().eod == tok.eod == 256


def test_byte_tokenizer_rejects_a_vocab_too_small_for_its_specials():
    with pytest.raises(ConfigError, match="vocab size of at least 258"):
        ByteTokenizer(vocab_size=257)


def test_site_packages_documents_are_whole_distributions_in_sorted_file_order():
    # both always installed here: pytest needs iniconfig, torch needs typing_extensions
    docs = corpus.site_packages_documents(packages=["typing_extensions", "iniconfig"])
    assert [d.name.split("==")[0].lower() for d in docs] == ["iniconfig", "typing_extensions"]
    text = b"".join(docs[1].chunks()).decode()
    headers = [line[4:-4] for line in text.splitlines() if line.startswith("==> ") and line.endswith(" <==")]
    assert "typing_extensions.py" in headers
    assert headers == sorted(headers)
    # the document carries the real file's content
    import typing_extensions

    assert open(typing_extensions.__file__).read() in text


def test_site_packages_documents_are_deterministic():
    a = [b"".join(d.chunks()) for d in corpus.site_packages_documents(packages=["pluggy"])]
    b = [b"".join(d.chunks()) for d in corpus.site_packages_documents(packages=["pluggy"])]
    assert a == b and len(a[0]) > 10_000


def test_unknown_distribution_is_a_config_error():
    with pytest.raises(ConfigError, match="no installed distribution named no-such-package"):
        corpus.site_packages_documents(packages=["no-such-package"])


def test_repository_documents_one_per_subdirectory_skipping_binary_and_hidden(tmp_path):
    (tmp_path / "repo_b" / "src").mkdir(parents=True)
    (tmp_path / "repo_b" / "src" / "main.py").write_text("print('b')\n")
    (tmp_path / "repo_b" / "README").write_text("B\n")
    (tmp_path / "repo_b" / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "repo_b" / ".git").mkdir()
    (tmp_path / "repo_b" / ".git" / "config").write_text("secret\n")
    (tmp_path / "repo_a").mkdir()
    (tmp_path / "repo_a" / "a.txt").write_text("A")
    (tmp_path / "notes.md").write_text("# notes\n")
    stats = corpus.CorpusStats()
    docs = corpus.repository_documents(tmp_path, stats=stats)
    assert [d.name for d in docs] == ["notes.md", "repo_a", "repo_b"]
    text_b = b"".join(docs[2].chunks()).decode()
    assert text_b == "==> repo_b/README <==\nB\n==> repo_b/src/main.py <==\nprint('b')\n"
    assert b"".join(docs[1].chunks()) == b"==> repo_a/a.txt <==\nA\n"
    assert stats.files_skipped_binary == 1


def test_large_files_are_skipped(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "big.txt").write_text("x" * 100)
    (tmp_path / "r" / "small.txt").write_text("y")
    stats = corpus.CorpusStats()
    (doc,) = corpus.repository_documents(tmp_path, max_file_bytes=50, stats=stats)
    assert b"".join(doc.chunks()) == b"==> r/small.txt <==\ny\n"
    assert stats.files_skipped_large == 1


def test_jsonl_documents_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    assert [b"".join(d.chunks()) for d in corpus.jsonl_documents([path])] == [b"one", b"two"]
    path.write_text(json.dumps({"body": "one"}) + "\n")
    with pytest.raises(ConfigError, match="d.jsonl:1.*--json-key"):
        list(corpus.jsonl_documents([path]))
    with pytest.raises(ConfigError, match="does not exist"):
        list(corpus.jsonl_documents([tmp_path / "missing.jsonl"]))


def test_text_line_documents(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"first line\n\nsecond\r\n")
    assert [b"".join(d.chunks()) for d in corpus.text_line_documents([path])] == [b"first line", b"second"]
    path.write_bytes(b"\xff\xfe bad\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        list(corpus.text_line_documents([path]))
