"""`bytescale demo --megatron-lm DIR`: the command line it starts (the run itself is Megatron's
own pretrain_gpt.py, covered end to end by test_pretrain_gpt_cpu.py)."""

import pytest

from megatron_bytescale.errors import ConfigError
from megatron_bytescale.megatron.cpu_pretrain import CPU_FLAGS, pretrain_gpt_command
from megatron_bytescale.planner.specs import MODEL_DIR, read_args_file

SIZES = dict(ranks=4, steps=30, capacity=1024, context=4096, step_tokens=16384, seed=0, lr=3e-3)


def test_command_is_torchrun_of_the_launcher_with_tiny_and_hdp_flags(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("")
    argv = pretrain_gpt_command(tmp_path, "data/corpus", **SIZES)
    assert argv[1:3] == ["-m", "megatron_bytescale.torchrun"]
    assert argv[3:9] == [
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "megatron_bytescale.launch",
        str(tmp_path / "pretrain_gpt.py"),
    ]
    flags = argv[9:]
    assert flags[: len(read_args_file(MODEL_DIR / "tiny.args"))] == read_args_file(MODEL_DIR / "tiny.args")

    def value(flag):
        return flags[flags.index(flag) + 1]

    assert value("--global-batch-size") == "4" and value("--seq-length") == "4096"
    assert value("--hdp-token-capacity") == "1024" and value("--data-path") == "data/corpus"
    assert value("--eval-iters") == "0" and value("--eval-interval") == "30"
    assert "--hybrid-data-parallel" in flags and "--use-distributed-optimizer" in flags
    assert set(CPU_FLAGS) <= set(flags) and "--bf16" not in flags


def test_refuses_a_folder_without_pretrain_gpt(tmp_path):
    with pytest.raises(ConfigError, match="pretrain_gpt.py not found"):
        pretrain_gpt_command(tmp_path, "data/corpus", **SIZES)
    (tmp_path / "pretrain_gpt.py").write_text("")
    with pytest.raises(ConfigError, match="multiple of --context"):
        pretrain_gpt_command(tmp_path, "data/corpus", **dict(SIZES, step_tokens=5000))
