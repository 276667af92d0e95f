"""``bytescale demo``: the main job on a CPU machine, with no GPU and no network.

Trains a tiny GPT (megatron-core's GPTModel with our ring attention) under HDP on 4 gloo
processes, on a real corpus: every Python source file of the installed megatron-core, one
document each (lengths from a few hundred to ~100K byte tokens), stored as a Megatron indexed
dataset. Each step the planner gives every sequence its own ring, sized to its length; the
per-step line shows the loss, tokens/s, ranks per sequence and P2P bytes. Then the same steps
run on the static DP x CP mesh (every packed micro-batch ringed over all CP ranks) with the same
attention code, and the two are compared in a table, a JSON file and a timeline plot of one
measured step per strategy. Deterministic for a seed; checkpoints (model, optimizer, data
position) every ``--checkpoint-every`` steps, and ``--resume`` continues exactly.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from .errors import BytescaleError
from .units import format_size

STRATEGY_NAMES = {"hdp": "HDP (balanced)", "static": "static DP x CP"}
CPU_PROFILE = Path(__file__).resolve().parent / "configs" / "profiles" / "tiny-cpu.json"
VOCAB = 512  # configs/models/tiny.args; the byte tokenizer's ids fit below it


@dataclass
class DemoConfig:
    ranks: int = 4
    steps: int = 30
    capacity: int = 1024  # tokens per micro-batch per rank
    context: int = 4096  # longest sequence: needs every rank at this capacity
    step_tokens: int = 16384  # global batch
    seed: int = 0
    model: str = "tiny"
    profile: str = str(CPU_PROFILE)  # the planner's cost model: measured on a 2-core CPU machine with gloo
    lr: float = 3e-3
    out: str = "runs/demo"
    data: str | None = None  # an indexed dataset prefix; default: built from megatron-core's sources
    strategies: tuple[str, ...] = ("hdp", "static")
    checkpoint_every: int = 10
    resume: bool = False
    plot_step: int = -1  # which step's measured timeline to plot (-1: the last)
    timeout_s: float = 1800.0


# ---------------------------------------------------------------------------- corpus
def megatron_core_sources() -> list[Path]:
    import megatron.core

    root = Path(megatron.core.__file__).resolve().parent
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def ensure_corpus(prefix: Path) -> str:
    """The demo's indexed dataset: built once from real source files, then reused."""
    from .data.corpus import text_file_documents
    from .data.indexed import write_indexed_dataset
    from .data.tokenizer import ByteTokenizer

    if Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists():
        return str(prefix)
    files = megatron_core_sources()
    if not files:
        raise BytescaleError("no megatron-core source files found to build the demo corpus; pass --data PREFIX")
    print(f"building the demo corpus from {len(files)} megatron-core source files (once) ...", flush=True)
    info = write_indexed_dataset(
        prefix, text_file_documents(files), ByteTokenizer(vocab_size=VOCAB), source="megatron-core sources"
    )
    print(
        f"corpus: {info.num_documents} documents (megatron-core source files), {info.num_tokens:,} tokens -> "
        f"{prefix}.bin/.idx"
    )
    return str(prefix)


# ------------------------------------------------------------------------ one rank
def plan_function(strategy: str, cfg: DemoConfig, world: int):
    from .data.planning import default_plan_fn
    from .planner.cost_model import CostModel
    from .planner.planner import PlannerConfig
    from .planner.specs import ModelSpec
    from .sim.cluster import Cluster
    from .sim.static_cp import static_plan

    if strategy == "hdp":
        cost = CostModel.from_profile(cfg.profile)
        return default_plan_fn(PlannerConfig(num_ranks=world, capacity=cfg.capacity, ranks_per_node=world), cost)
    if strategy == "static":
        cluster = Cluster(gpus=world, gpus_per_node=world)
        layers = ModelSpec.load(cfg.model).num_layers
        return partial(static_plan, cluster=cluster, capacity=cfg.capacity, context=cfg.context, num_layers=layers)
    raise BytescaleError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGY_NAMES)}")


def checkpoint_dir(cfg: DemoConfig, strategy: str) -> Path:
    return Path(cfg.out) / "checkpoints" / strategy


# Settings a checkpoint was trained with that a resume must share: any of them changes the run
# that continues from it (the data order, the plan, the update). --steps may grow.
RESUME_SETTINGS = ("ranks", "capacity", "context", "step_tokens", "seed", "model", "lr")
FLAGS = {"step_tokens": "--step-tokens"}


def trained_with(cfg: DemoConfig, strategy: str) -> dict:
    out = {k: getattr(cfg, k) for k in RESUME_SETTINGS}
    if strategy == "hdp":  # the planner's cost model shapes HDP's plan
        out["profile"] = str(Path(cfg.profile).resolve())
    return out


def resume_point(cfg: DemoConfig, strategy: str) -> Path | None:
    """The newest valid checkpoint of ``strategy`` (the skipped ones are reported); refuses one
    whose settings contradict ``cfg``."""
    from .checkpoint_io import newest_valid

    found = newest_valid(checkpoint_dir(cfg, strategy))
    lines = found.report()
    for line in lines[: len(found.skipped)]:
        print(f"{STRATEGY_NAMES[strategy]}: {line}")
    if found.path is None:
        print(f"{STRATEGY_NAMES[strategy]}: no valid checkpoint in {checkpoint_dir(cfg, strategy)}, starting at step 0")
        return None
    saved = found.state.get("config", {})
    for key, value in trained_with(cfg, strategy).items():
        if key in saved and saved[key] != value:
            flag = FLAGS.get(key, "--" + key.replace("_", "-"))
            raise BytescaleError(
                f"{flag} {value} contradicts {found.path}, trained with {flag} {saved[key]}; resume with {flag} "
                f"{saved[key]}, or start afresh in another --out"
            )
    print(f"{STRATEGY_NAMES[strategy]}: {lines[-1]}")
    return found.path


def check_inputs(cfg: DemoConfig) -> None:
    """Every setting the ranks would trip over, checked here in the parent before any starts."""
    from .local_world import check_world_size
    from .planner.cost_model import CostModel
    from .planner.specs import ModelSpec

    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise BytescaleError(f"--lr {cfg.lr}: the learning rate must be a positive finite number, e.g. --lr 3e-3")
    if cfg.checkpoint_every < 0:
        raise BytescaleError(
            f"--checkpoint-every {cfg.checkpoint_every}: give a number of steps, or 0 for no checkpoints"
        )
    check_world_size(cfg.ranks, "--ranks")
    if cfg.context > cfg.capacity * cfg.ranks:
        raise BytescaleError(
            f"--context {cfg.context} needs {-(-cfg.context // cfg.capacity)} ranks at capacity {cfg.capacity}, "
            f"but there are {cfg.ranks}: raise --capacity or --ranks, or lower --context"
        )
    if cfg.step_tokens < cfg.context:
        raise BytescaleError(
            f"--step-tokens {cfg.step_tokens} is smaller than --context {cfg.context}: a context-long document "
            f"could never be scheduled; raise --step-tokens to at least {cfg.context} or lower --context"
        )
    ModelSpec.load(cfg.model)
    if "hdp" in cfg.strategies:
        CostModel.from_profile(cfg.profile)


def check_dataset(cfg: DemoConfig) -> None:
    """Open the dataset as the ranks will, and scan its token ids against the vocabulary."""
    import numpy as np

    from .data.indexed import DocumentDataset
    from .data.sampler import GlobalBatchSampler

    ds = DocumentDataset(cfg.data, vocab_size=VOCAB)
    GlobalBatchSampler(ds.lengths, step_tokens=cfg.step_tokens, context_length=cfg.context, seed=cfg.seed)
    tokens = np.memmap(ds.bin_path, dtype=ds.dtype, mode="r")
    top = int(tokens.max()) if tokens.size else 0
    if top >= VOCAB:
        doc = int(np.searchsorted(np.cumsum(ds.lengths), int(np.argmax(tokens >= VOCAB)), side="right"))
        raise BytescaleError(
            f"--data {cfg.data}: token id {top} (first in document {doc}) is outside the tiny model's vocabulary of "
            f"{VOCAB}; tokenize with `bytescale prepare-data` (byte tokens) or another dataset"
        )


def _train_rank(rank: int, world: int, cfg: DemoConfig, strategy: str, resume_from: str | None = None):
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from . import checkpoint_io
    from .data.local_loader import LocalDataLoader
    from .folder_lock import hold_as_worker
    from .megatron import local_run
    from .runtime.offload import ActivationOffloader, transformer_layers

    hold_as_worker(cfg.out)  # a later run of this folder refuses to start while this rank lives

    model, group = local_run.setup_model(cfg.model, seed=cfg.seed)
    offloader = ActivationOffloader(transformer_layers(model))  # applies each micro-batch's planned ratio
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    loader = LocalDataLoader(
        cfg.data,
        plan_fn=plan_function(strategy, cfg, world),
        step_tokens=cfg.step_tokens,
        context_length=cfg.context,
        seed=cfg.seed,
        rank=rank,
        vocab_size=VOCAB,
    )
    start = 0
    if resume_from is not None:
        state = checkpoint_io.load(resume_from)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["data"])
        start = state["step"]
    plot_step = cfg.steps - 1 if cfg.plot_step < 0 else cfg.plot_step
    records = []
    bar = tqdm(
        total=cfg.steps, initial=start, disable=rank != 0, desc=STRATEGY_NAMES[strategy], unit="step", file=sys.stderr
    )
    for step in range(start, cfg.steps):
        dist.barrier(group)  # a common start: the step time is the slowest rank's
        t0 = time.perf_counter()
        batch = loader.next_step()
        for p in model.parameters():
            p.grad = None
        result = local_run.run_step(batch, model, group, offloader=offloader)
        optimizer.step()
        dist.barrier(group)
        seconds = time.perf_counter() - t0
        moved = torch.tensor([result.stats.p2p_bytes, result.stats.offloaded_bytes], dtype=torch.int64)
        dist.all_reduce(moved, group=group)
        gathered = None
        if step == plot_step:  # every rank's micro-batch timings, on the common step clock
            gathered = [None] * world
            ops = [
                (m.start - t0, m.forward_end - t0, m.end - t0, m.forward_wait_s, m.backward_wait_s)
                for m in result.stats.timings
            ]
            dist.all_gather_object(gathered, ops, group=group)
        tokens = sum(batch.plan.seq_lens)
        rings = Counter(batch.plan.ring_sizes().values())
        record = {
            "step": step,
            "loss": result.loss,
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "p2p_bytes": int(moved[0]),
            "offloaded_bytes": int(moved[1]),
            "sequences": len(batch.plan.seq_lens),
            "ranks_per_sequence": dict(sorted(rings.items())),
            "micro_batches": [len(mbs) for mbs in batch.plan.ranks],
            "timeline": gathered,
        }
        records.append(record)
        if rank == 0:
            ring_text = " ".join(f"{n}x{size}" for size, n in record["ranks_per_sequence"].items())
            bar.write(
                f"  step {step + 1:>3}/{cfg.steps}  loss {result.loss:7.4f}  {record['tokens_per_s']:>8,.0f} tok/s  "
                f"ranks/seq [{ring_text}]  P2P {format_size(record['p2p_bytes'])}B  offloaded "
                f"{format_size(record['offloaded_bytes'])}B"
            )
            bar.update(1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                checkpoint_io.save(
                    checkpoint_dir(cfg, strategy) / checkpoint_io.checkpoint_name(step + 1),
                    {
                        "step": step + 1,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "data": loader.state_dict(),
                        "config": trained_with(cfg, strategy),
                    },
                )
    bar.close()
    local_run.teardown()
    return records if rank == 0 else None


# ------------------------------------------------------------------------ driver
def run_strategy(cfg: DemoConfig, strategy: str, resume_from: Path | None = None) -> list[dict]:
    from .local_world import preload, run_local_world

    # nothing else is printed until the first step ends: say what the ranks do until then
    print(
        f"starting {cfg.ranks} gloo ranks: each imports torch and megatron-core and builds the model, "
        "then plans and runs step 1 ...",
        flush=True,
    )
    preload(
        [
            "megatron.core.models.gpt.gpt_model",
            "megatron_bytescale.megatron.local_run",
            "megatron_bytescale.data.local_loader",
        ]
    )
    return run_local_world(
        _train_rank,
        cfg.ranks,
        cfg,
        strategy,
        None if resume_from is None else str(resume_from),
        timeout_s=cfg.timeout_s,
    )[0]


def summarize(records: list[dict]) -> dict:
    if not records:
        return {}
    timed = records[1:] if len(records) > 2 else records  # the first step warms up caches
    return {
        "steps": len(records),
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "step_s_median": statistics.median(r["seconds"] for r in timed),
        "step_s_total": sum(r["seconds"] for r in timed),  # throughput: strategies compare by total time
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "p2p_bytes_per_step_median": statistics.median(r["p2p_bytes"] for r in records),
        "p2p_bytes_total": sum(r["p2p_bytes"] for r in records),
    }


def comparison_table(summaries: dict[str, dict]) -> str:
    rows = [("", *[STRATEGY_NAMES[s] for s in summaries])]
    fmt = {
        "loss (first -> final)": lambda s: f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}",
        "step time, median": lambda s: f"{s['step_s_median']:.3f} s",
        "tokens/s, median": lambda s: f"{s['tokens_per_s_median']:,.0f}",
        "P2P bytes per step, median": lambda s: f"{format_size(s['p2p_bytes_per_step_median'])}B",
    }
    for label, f in fmt.items():
        rows.append((label, *[f(s) for s in summaries.values()]))
    if "hdp" in summaries and "static" in summaries:
        h, st = summaries["hdp"], summaries["static"]
        # bytes moved are exact; step times on a shared CPU are not a speed claim either way
        ratio = h["p2p_bytes_per_step_median"] / max(st["p2p_bytes_per_step_median"], 1)
        rows.append(
            (
                "HDP vs static",
                f"{ratio:.2f}x the static mesh's P2P bytes",
                f"total step time {h['step_s_total'] / st['step_s_total']:.2f}x static's (CPU timing: noisy)",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def plot_measured(runs: dict[str, list[dict]], path: Path) -> Path | None:
    """One measured step per strategy as a Gantt chart: per rank, each micro-batch's forward and
    backward, with the time spent waiting on ring transfers drawn as exposed communication."""
    import numpy as np

    from .sim.plot import plot_timelines
    from .sim.timeline import BACKWARD, FORWARD, Timeline

    timelines = {}
    for strategy, records in runs.items():
        rec = next((r for r in reversed(records) if r["timeline"]), None)
        if rec is None:
            continue
        ops = []
        for timings in rec["timeline"]:
            rows = []
            for start, fwd_end, end, fwd_wait, bwd_wait in timings:
                rows.append((start, fwd_end, FORWARD, fwd_end - start - fwd_wait, fwd_wait, 0.0))
                rows.append((fwd_end, end, BACKWARD, end - fwd_end - bwd_wait, bwd_wait, 0.0))
            ops.append(np.array(rows, dtype=float).reshape(-1, 6))
        moved = rec["offloaded_bytes"]  # copied inside the saved-tensor hooks: part of the compute bars
        offloaded = f"; offloaded {format_size(moved)}B, its copies inside the compute" if moved else ""
        timelines[f"{STRATEGY_NAMES[strategy]} (measured step {rec['step'] + 1}{offloaded})"] = Timeline(
            step_time=rec["seconds"], num_ranks=len(ops), stages=1, ops=ops
        )
    if not timelines:
        return None
    return plot_timelines(timelines, path, title="bytescale demo: one measured step per strategy (gloo on CPU)")


def run_demo(cfg: DemoConfig) -> dict:
    from .folder_lock import FolderLock

    check_inputs(cfg)
    with FolderLock(cfg.out, "bytescale demo"):  # one run per --out, also against a previous run's ranks
        return _run_demo(cfg)


def _run_demo(cfg: DemoConfig) -> dict:
    out = Path(cfg.out)
    # checkpoints first: a resume that contradicts its checkpoint is refused before any other work
    resume = {s: resume_point(cfg, s) for s in cfg.strategies} if cfg.resume else {}
    # megatron-core's indexed dataset reads the corpus: its first import takes seconds
    print("loading torch and megatron-core to read the dataset ...", flush=True)
    if cfg.data is None:
        cfg.data = ensure_corpus(out / "data" / "megatron_core_sources")
    check_dataset(cfg)
    runs = {}
    for strategy in cfg.strategies:
        print(
            f"\n{STRATEGY_NAMES[strategy]}: {cfg.ranks} gloo ranks, {cfg.steps} steps of "
            f"{format_size(cfg.step_tokens)} tokens, "
            f"capacity {format_size(cfg.capacity)}, context {format_size(cfg.context)}",
            flush=True,
        )
        runs[strategy] = run_strategy(cfg, strategy, resume.get(strategy))
    summaries = {s: summarize(r) for s, r in runs.items() if r}
    if not summaries:
        print("nothing to do: every strategy's latest checkpoint is already at --steps")
        return {}
    print("\n" + comparison_table(summaries))
    report = {
        "config": asdict(cfg),
        "summary": summaries,
        "steps": {s: [{k: v for k, v in r.items() if k != "timeline"} for r in recs] for s, recs in runs.items()},
    }
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    plot = plot_measured(runs, out / "timeline.png")
    print(f"\nwrote {out / 'demo.json'}" + (f" and {plot}" if plot else ""))
    return report
