"""megatron/elastic.py without Megatron: which resumes on another world size are refused (one
line naming the fix) and the line a resize or an elastic restart prints."""

from types import SimpleNamespace

import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.megatron.elastic import SavedWorld, check_resize, resume_line

SAVED = SavedWorld(iteration=200, world_size=16, hdp_size=4, tp=2, pp=2, hdp=True)


def _args(**overrides):
    base = dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        ckpt_format="torch_dist",
        use_distributed_optimizer=True,
        data_parallel_size=3,
        world_size=12,
        load="/ckpt",
    )
    return SimpleNamespace(**{**base, **overrides})


def test_another_hdp_size_with_the_same_tp_and_pp_in_torch_dist_is_accepted():
    check_resize(SAVED, _args())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(tensor_model_parallel_size=4),
            "written with TP 2 x PP 2, this run has TP 4 x PP 2.*"
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
        ),
        (dict(pipeline_model_parallel_size=1), "this run has TP 2 x PP 1"),
        (
            dict(ckpt_format="torch"),
            "--ckpt-format torch: .* on 4 HDP ranks resumes on 3 only from torch_dist.*resume on 16 ranks",
        ),
    ],
)
def test_what_is_not_resharded_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as exc:
        check_resize(SAVED, _args(**overrides))
    assert "\n" not in str(exc.value)


def test_resume_and_restart_lines(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    line = resume_line(SAVED, _args())
    assert line.startswith(
        "elastic resume: world 16 -> 12 (HDP ranks 4 -> 3, TP 2, PP 2), resuming from checkpoint "
        "iteration 200 in /ckpt; RNG states not restored"
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert resume_line(SAVED, _args(data_parallel_size=4, world_size=16)).startswith(
        "elastic restart 2: world 16 -> 16 (HDP ranks 4 -> 4, TP 2, PP 2), resuming from checkpoint iteration 200"
    )
    assert "RNG states restored per HDP rank" in resume_line(SAVED, _args(data_parallel_size=4, world_size=16))
    assert resume_line(None, _args()) == (
        "elastic restart 2: world 12 (3 HDP ranks), no checkpoint in --load /ckpt: training starts at iteration 0"
    )


def test_a_finetune_load_is_left_to_megatron(monkeypatch):
    """--finetune loads the model alone, which Megatron reshards to any layout (the PP=2 test of
    tests/test_pretrain_gpt_cpu.py starts from a TP 1 x PP 1 checkpoint): no world check."""
    from megatron_bytescale.megatron import elastic

    def no_check(*unused):
        raise AssertionError("the saved world must not be read for --finetune")

    monkeypatch.setattr(elastic, "saved_world", no_check)
    calls = []
    load = elastic.elastic_load(
        lambda *a, **k: calls.append((a, k)) or "loaded", lambda: SimpleNamespace(finetune=True, load="/ckpt", rank=0)
    )
    assert load("model", "optimizer", "scheduler") == "loaded" and calls == [(("model", "optimizer", "scheduler"), {})]
