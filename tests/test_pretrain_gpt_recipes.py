"""Published long-context recipes' data flags through Megatron-LM's own ``pretrain_gpt.py`` under
HDP on CPU/gloo (core_v0.16.1 or core_v0.19; CI runs this file against both): the tiny model,
4 ranks against 1 rank, 3 iterations, Megatron's optimizer.

* a weighted blend (``--data-path 0.3 A 0.7 B``) cut by ``--split`` with validation and a test
  split, on datasets written by Megatron's own ``tools/preprocess_data.py`` with a Hugging Face
  tokenizer (A with ``--append-eod``, B without; ``--tokenizer-type HuggingFaceTokenizer``):
  the patched script on 4 HDP ranks gives one rank's losses, gradient norms, validation and
  test losses;
* ``--mock-data`` (``--hdp-mock-lengths``), through the launcher on the unpatched tree: a run
  stopped at iteration 2 and resumed gives the uninterrupted run's iteration 3 (the same mock
  batches), and the step log reports tokens per second per GPU;
* ``--sft`` on Megatron's JSONL of conversations with ``SFTTokenizer`` (a tokenizer built here,
  nothing downloaded), conversations longer than a rank's token capacity (rings carry the loss
  masks of their answer tokens): 4 HDP ranks give one rank's losses and gradient norms.

Needs MEGATRON_LM_DIR; skipped, with that reason, without it.
"""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_pretrain_gpt_cpu import TIMEOUT, Run, _environment, dry_run, launcher_flags
from tokenizer_support import build_tokenizer_dir

from megatron_lm import MEGATRON_LM_DIR, ROOT, needs_tree, patched_copy

pytestmark = needs_tree

TEST = re.compile(r"validation loss at iteration (\d+) on test set \| lm loss value: (\S+) \|")
THROUGHPUT = re.compile(r"hdp iteration \d+: .* (\d+) tokens, ([\d.]+) tokens/s per GPU")
# what train_local.sh puts on the command line for its own data: replaced by each recipe's
SCRIPT_DATA_FLAGS = {"--data-path": 1, "--eval-iters": 1, "--eval-interval": 1, "--tokenizer-type": 1}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("recipes")


def _texts(limit=60):
    return [p.read_text() for p in sorted((ROOT / "megatron_bytescale").rglob("*.py"))[:limit]]


@pytest.fixture(scope="module")
def tokenizer(work):
    return build_tokenizer_dir(work / "tokenizer", _texts())


@pytest.fixture(scope="module")
def preprocessed(work, tokenizer):
    """Two indexed datasets written by Megatron's tools/preprocess_data.py with the Hugging Face
    tokenizer: one document per JSON line (one of them empty), with and without --append-eod."""
    source = work / "docs.jsonl"
    texts = [t[:2000] for t in _texts(40)]
    texts.insert(5, "")  # an empty text: preprocess_data writes an empty document
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    runner = (
        "import runpy, sys; import megatron_bytescale.triton_stand_ins as t; t.install(); "
        "sys.argv = ['tools/preprocess_data.py'] + sys.argv[1:]; "
        "runpy.run_path('tools/preprocess_data.py', run_name='__main__')"
    )

    def run(name, extra):
        command = [sys.executable, "-c", runner, "--input", str(source), "--output-prefix", str(work / name)]
        command += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer), "--workers", "1"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([MEGATRON_LM_DIR, str(ROOT)]), OMP_NUM_THREADS="1")
        proc = subprocess.run(
            command + extra, cwd=MEGATRON_LM_DIR, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return str(work / f"{name}_text_document")

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda a: run(*a), (("eod", ["--append-eod"]), ("noeod", []))))


@pytest.fixture(scope="module")
def patched_tree(work):
    tree = patched_copy(work / "megatron-lm")
    return tree


def _base_flags(data_path: str, **variables) -> list[str]:
    """train_local.sh's command line for the tiny model (fp32, local transformer, 3 iterations),
    without its own data flags."""
    proc = dry_run(NPROC=4, DATA_PATH=data_path, TRAIN_ITERS=3, GLOBAL_BATCH_SIZE=8, **variables)
    assert proc.returncode == 0, proc.stderr
    flags, out = launcher_flags(proc), []
    skip = 0
    for word in flags:
        if skip:
            skip -= 1
        elif word in SCRIPT_DATA_FLAGS:
            skip = SCRIPT_DATA_FLAGS[word]
        else:
            out.append(word)
    return out + ["--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--hidden-dropout", "0"]


def pretrain(tree: Path, nproc: int, flags: list[str], *, launcher: bool) -> Run:
    """pretrain_gpt.py on ``nproc`` gloo ranks (megatron_bytescale.torchrun, as the scripts start it)."""
    entry = ["-m", "megatron_bytescale.launch"] if launcher else []
    command = [sys.executable, "-m", "megatron_bytescale.torchrun", "--standalone", "--nproc-per-node", str(nproc)]
    env = _environment(tree, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]))
    proc = subprocess.run(
        [*command, *entry, str(tree / "pretrain_gpt.py"), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    return Run(proc)


def _close(a: Run, b: Run, what: str) -> None:
    """Megatron prints 7 digits; HDP ranks add their partial sums in another order (fp32)."""
    assert sorted(a.losses) == sorted(b.losses) == [1, 2, 3], (what, a.summary(), b.summary())
    for i in (1, 2, 3):
        assert abs(float(a.losses[i]) - float(b.losses[i])) < 5e-6, (what, i, a.losses, b.losses)
        assert abs(float(a.grad_norms[i]) - float(b.grad_norms[i])) <= 1e-3, (what, i, a.grad_norms, b.grad_norms)


def _pair(tree, flags, *, launcher=False, one_rank=()):
    """The run on 4 HDP ranks and on one (``one_rank``: flags only that one takes)."""
    runs = ((4, flags), (1, [*flags, *one_rank]))
    with ThreadPoolExecutor(2) as pool:  # mostly start-up: overlap them
        four, one = pool.map(lambda a: pretrain(tree, *a, launcher=launcher).check(), runs)
    return four, one


def test_weighted_blend_with_split_on_preprocess_data_datasets_equals_one_rank(patched_tree, preprocessed, tokenizer):
    """The Llama-3 pretraining recipes' data flags: a weighted blend cut by --split, validated every
    2 iterations, the test split evaluated after training; the datasets are Megatron's own
    preprocess_data.py output (one with EOD, one without, an empty document skipped)."""
    with_eod, without_eod = preprocessed
    flags = _base_flags(with_eod) + [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
        "--data-path", "0.3", with_eod, "0.7", without_eod, "--split", "80,10,10",
        "--eval-iters", "1", "--eval-interval", "2", "--use-cpu-initialization",
    ]  # fmt: skip
    four, one = _pair(patched_tree, flags)
    print(f"blend: 4 ranks {four.losses} {four.validation}; one rank {one.losses} {one.validation}")
    _close(four, one, "blend")
    assert re.search(r"tokenizer_type \.+ HuggingFaceTokenizer", four.log)
    assert [i for i, _ in four.validation] == [i for i, _ in one.validation] == ["2"], four.summary()
    assert abs(float(four.validation[0][1]) - float(one.validation[0][1])) < 5e-6, (four.validation, one.validation)
    test4, test1 = TEST.findall(four.log), TEST.findall(one.log)
    assert len(test4) == len(test1) == 1 and abs(float(test4[0][1]) - float(test1[0][1])) < 5e-6, (test4, test1)


def test_mock_data_resumes_on_the_same_batches_and_logs_tokens_per_second(work, preprocessed):
    """--mock-data with Megatron's dynamic-CP benchmark lengths (log-normal, scaled to this
    context), the launcher on the unpatched tree: the run stopped at iteration 2 and resumed
    continues with the uninterrupted run's iteration 3."""
    save = work / "mock_ckpt"
    flags = _base_flags(preprocessed[0], LOG_INTERVAL=1) + [
        "--mock-data", "--hdp-mock-lengths", "lognormal:mean=96,sigma=1.5,min=16,max=256",
        "--eval-iters", "0", "--eval-interval", "3", "--use-cpu-initialization", "--tokenizer-type", "NullTokenizer",
        "--save", str(save), "--save-interval", "2", "--ckpt-format", "torch",
    ]  # fmt: skip
    tree = Path(MEGATRON_LM_DIR)
    full = pretrain(tree, 4, flags, launcher=True).check()
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = pretrain(tree, 4, [*flags, "--load", str(save)], launcher=True).check()
    print(f"mock: uninterrupted {full.losses} {full.grad_norms}; resumed {resumed.losses} {resumed.grad_norms}")
    assert sorted(full.losses) == [1, 2, 3] and sorted(resumed.losses) == [3], resumed.summary()
    assert resumed.losses[3] == full.losses[3] and resumed.grad_norms[3] == full.grad_norms[3]
    rates = THROUGHPUT.findall(full.log)
    assert len(rates) == 3 and all(int(tokens) > 0 and float(rate) > 0 for tokens, rate in rates), full.summary()


def _conversations(path: Path) -> Path:
    """Megatron's SFT JSONL: one conversation per line, and a line packing two (each starts with
    its system message); answers of up to ~2,000 characters, longer than a rank's capacity in tokens."""
    texts = _texts(30)
    lines = []
    for i in range(12):
        body = texts[i]
        answer = body[: 300 + 150 * (i % 12)]
        conversation = [
            {"role": "system", "content": "You explain Python code."},
            {"role": "user", "content": f"What does this file start with? {body[:80]}"},
            {"role": "assistant", "content": answer},
        ]
        if i % 4 == 3:
            conversation += [
                {"role": "user", "content": "And after that?"},
                {"role": "assistant", "content": body[2000:2400] or "Nothing more."},
            ]
        if i % 5 == 4:
            conversation += [
                {"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Name one word in it."},
                {"role": "assistant", "content": body.split()[1]},
            ]
        lines.append(json.dumps({"messages": conversation}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sft_conversations_longer_than_a_rank_equal_one_rank(patched_tree, work, tokenizer, preprocessed):
    """--sft with Megatron's SFTTokenizer and the nemotron-h-aligned prompt format: system and
    user tokens out of the loss, each conversation one document on its own ranks, nothing padded."""
    data = _conversations(work / "conversations.jsonl")
    from transformers import AutoTokenizer

    longest = max(len(json.loads(line)["messages"][2]["content"]) for line in data.read_text().splitlines())
    answer = next(m["content"] for line in data.read_text().splitlines() for m in json.loads(line)["messages"][2:3]
                  if len(m["content"]) == longest)  # fmt: skip
    assert len(AutoTokenizer.from_pretrained(str(tokenizer))(answer)["input_ids"]) > 256  # a ring's worth
    flags = _base_flags(preprocessed[0], SEQ_LENGTH=1024, HDP_TOKEN_CAPACITY=256) + [
        "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", str(tokenizer),
        "--sft-tokenizer-prompt-format", "nemotron-h-aligned", "--train-data-path", str(data),
        "--eval-iters", "0", "--eval-interval", "3", "--use-cpu-initialization",
    ]  # fmt: skip
    # one rank holds the longest conversation whole (the capacity packs, it changes no sum)
    four, one = _pair(patched_tree, flags, one_rank=["--hdp-token-capacity", "1024"])
    print(f"sft: 4 ranks {four.losses} {four.grad_norms}; one rank {one.losses} {one.grad_norms}")
    _close(four, one, "sft")
    assert "hdp: tokenizing the train conversations" in four.log
