"""What determines the data stream, as a checkpoint records it (megatron/data_stream.py): each
field by name, compared one by one on resume; equal continues from the recorded position,
different is refused in one line naming each field, or, deliberately, continues where the
order allows and restarts where it does not. (A record written by Megatron's real save is read
in tests/test_megatron_reliability.py; the launcher's refusal in tests/test_launch_checks.py.)"""

from types import SimpleNamespace

import pytest

from megatron_bytescale.data.indexed import write_indexed_dataset
from megatron_bytescale.data.sampler import Position
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.megatron import data_stream

from data_support import SMALL_PACKAGES, build_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"), packages=SMALL_PACKAGES[:1])


def _args(corpus, folder, **changes):
    args = dict(
        hdp_step_tokens=1024,
        seq_length=256,
        seed=1234,
        data_path=[corpus],
        train_data_path=None,
        load=str(folder),
        hdp_accept_data_change=False,
    )
    return SimpleNamespace(**dict(args, **changes))


@pytest.fixture
def saved(corpus, tmp_path):
    folder = tmp_path / "iter_0000004"
    folder.mkdir()
    data_stream.write(folder, _args(corpus, tmp_path), 4, SimpleNamespace(step=4, position=Position(1, 3, 10)))
    return folder


def test_the_record_names_each_field_and_the_position(saved, corpus):
    body = data_stream.read(saved)
    assert body["iteration"] == 4 and body["position"] == {"epoch": 1, "index": 3, "offset": 10}
    assert sorted(body["fields"]) == ["blend", "dataset", "seed", "seq_length", "split", "step_tokens"]
    assert body["fields"]["dataset"] == [data_stream.dataset_identity(corpus)]
    # one prefix: no blend; Megatron's default --split with --data-path: training takes 96.9%
    assert body["fields"]["blend"] is None and body["fields"]["split"] == [[0.0, 0.969]]


def test_an_unchanged_stream_continues_from_the_recorded_position(saved, corpus, tmp_path):
    point = data_stream.resume_point(saved, _args(corpus, tmp_path), 4)
    assert point == data_stream.ResumePoint({"epoch": 1, "index": 3, "offset": 10}, None)


def test_a_changed_stream_is_refused_naming_each_field(saved, corpus, tmp_path):
    other = str(tmp_path / "other")
    write_indexed_dataset(other, [_doc("a different corpus")])
    with pytest.raises(ConfigError) as error:
        data_stream.resume_point(saved, _args(corpus, tmp_path, seed=7, hdp_step_tokens=2048, data_path=[other]), 4)
    said = str(error.value)
    before, now = data_stream.dataset_identity(corpus), data_stream.dataset_identity(other)
    assert said == (
        f"--load {tmp_path}: iteration 4 was trained on another data stream (--hdp-step-tokens 1024 then, 2048 now; "
        f"--seed 1234 then, 7 now; the dataset (--data-path) then index sha256 {before['index_sha256'][:12]}, .bin "
        f"sample {before['bin_sample_sha256'][:12]}, now index sha256 {now['index_sha256'][:12]}, .bin sample "
        f"{now['bin_sample_sha256'][:12]}): resume with the settings it was saved with, or pass "
        "--hdp-accept-data-change to continue on the new stream deliberately"
    )


def test_a_deliberate_change_continues_where_the_order_allows(saved, corpus, tmp_path):
    # another step size keeps the documents' order: the stream goes on from the recorded position
    same_order = data_stream.resume_point(
        saved, _args(corpus, tmp_path, hdp_step_tokens=2048, hdp_accept_data_change=True), 4
    )
    assert same_order.position == {"epoch": 1, "index": 3, "offset": 10}
    assert same_order.line.endswith("the stream continues where the checkpoint left it (--hdp-accept-data-change)")
    # another seed is another order: the new stream starts at its beginning
    new_order = data_stream.resume_point(saved, _args(corpus, tmp_path, seed=7, hdp_accept_data_change=True), 4)
    assert new_order.position == data_stream.START
    assert new_order.line.endswith(
        "--seed 1234 then, 7 now; the new stream starts at its beginning (--hdp-accept-data-change)"
    )


def test_a_checkpoint_without_a_record_is_replayed_saying_so(corpus, tmp_path):
    point = data_stream.resume_point(tmp_path, _args(corpus, tmp_path), 4)
    assert point.position is None and "holds no data-stream record" in point.line and "replayed" in point.line


def test_a_field_added_later_compares_with_what_older_records_stand_for(saved, corpus, tmp_path, monkeypatch):
    # a tokenizer's name, say: records written before the field existed stand for "none"
    field = data_stream.Field("tokenizer", "--tokenizer-type", lambda a: getattr(a, "tok", None), False, absent=None)
    monkeypatch.setattr(data_stream, "FIELDS", (*data_stream.FIELDS, field))
    assert data_stream.resume_point(saved, _args(corpus, tmp_path), 4).line is None
    with pytest.raises(ConfigError, match=r"--tokenizer-type None then, bpe now"):
        data_stream.resume_point(saved, _args(corpus, tmp_path, tok="bpe"), 4)


def test_a_changed_blend_or_split_is_refused(saved, corpus, tmp_path):
    other = str(tmp_path / "other")
    write_indexed_dataset(other, [_doc("a second corpus for the blend")])
    blend = _args(corpus, tmp_path, data_path=["0.3", corpus, "0.7", other])
    with pytest.raises(ConfigError, match=r"--data-path's weights None then, \[0\.3, 0\.7\] now"):
        data_stream.resume_point(saved, blend, 4)
    with pytest.raises(ConfigError, match=r"--split \[\[0\.0, 0\.969\]\] then, \[\[0\.0, 0\.9\]\] now"):
        data_stream.resume_point(saved, _args(corpus, tmp_path, split="90,10,0"), 4)


def test_a_damaged_record_is_one_line(saved, corpus, tmp_path):
    (saved / data_stream.RECORD).write_text("{not json")
    with pytest.raises(ConfigError, match=r"bytescale-data-stream\.json: unreadable .*restore it from a copy"):
        data_stream.resume_point(saved, _args(corpus, tmp_path), 4)


def _doc(text):
    from megatron_bytescale.data.corpus import SourceDocument

    return SourceDocument("doc", lambda: iter([text.encode()]))
