"""The simulator's run: compare strategies on a simulated cluster, step by step
(``bytescale simulate``, ``commands/simulate.py``, parses its flags and prints the table).

Every step draws one global batch of sequence lengths (a synthetic workload, a lengths
file, or the user's own Megatron dataset), each strategy plans it, and the timeline engine
costs every plan with the same cost model on the same cluster. Speedups and "x lower bound"
are ratios of totals over the steps (``sim/throughput.py``: what a training run measures),
other figures means over the steps; ``--json`` keeps every step's figures. The Gantt chart
shows the first step.

With ``--data-path PREFIX`` (a Megatron indexed dataset, read through megatron-core) the
batches are the ones training would see: ``GlobalBatchSampler`` over the dataset's document
lengths, documents cut at ``--context``, ``--global-batch-tokens`` per step, the same
``--seed`` (a shadow run of the training's first steps: "what would HDP save on my data?").
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from ..data.workloads import lengths_from_file, read_lengths_file, sample_lengths, training_batches
from ..errors import ConfigError, PlanError
from ..planner.cost_model import CostModel
from ..planner.specs import HardwareSpec, ModelSpec
from ..units import format_size
from ..virtual_stages import check_vpp
from .cluster import Cluster
from .megatron_dcp_dev import dev_tree
from .static_cp import StrategyError
from .strategies import LATENT_ONLY, NEEDS_DEV_TREE, STRATEGIES, StrategyInput, make_plan, parse_strategies
from .throughput import means, totals
from .timeline import Timeline, evaluate


@dataclass(frozen=True)
class SimConfig:
    gpus: int
    context: int
    capacity: int
    global_batch_tokens: int
    model: str = "llama-7b"
    hardware: str = "h100"
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism (MoE models): aligned micro-batch slots per EP group
    gpus_per_node: int | None = None  # default: the hardware's
    dataset: str = "byted"
    lengths_file: str | None = None
    strategies: tuple[str, ...] = tuple(n for n in STRATEGIES if n not in LATENT_ONLY + NEEDS_DEV_TREE)
    steps: int = 5
    seed: int = 0
    validate: str = "first"  # "first" | "all" | "none": which steps' plans to check with Plan.validate
    dkv_bf16: bool = False  # ring attention sends the backward's dK/dV accumulators in bf16
    host_memory_per_gpu: int | None = None  # bytes; default: the hardware spec's host_memory_bytes
    # a Megatron indexed dataset, or a blend (W1 P1 W2 P2 ...): draw the batches training would see
    data_path: str | list[str] | None = None
    pipeline_schedule: str = "1f1b"  # HDP plans with PP: "1f1b", or "search" for per-stage orders
    vpp: int = 1  # model chunks per pipeline device (virtual pipeline stages), every strategy
    megatron_dev: str | None = None  # Megatron-LM dev tree for megatron-dcp-dev (default: $BYTESCALE_MEGATRON_DEV)


@dataclass
class SimReport:
    config: SimConfig
    cluster: Cluster
    cost: CostModel
    steps: dict[str, list[dict]] = field(default_factory=dict)  # strategy -> metrics per step
    errors: dict[str, str] = field(default_factory=dict)  # strategy -> why it produced no result
    notes: dict[str, list[str]] = field(default_factory=dict)
    timelines: dict[str, Timeline] = field(default_factory=dict)  # first step
    batch_stats: list[tuple[int, int, int]] = field(default_factory=list)  # per step: sequences, longest, tokens
    dataset: dict = field(default_factory=dict)  # --data-path: documents, tokens, longest document
    lower_bound_first: float = 0.0

    def results(self) -> dict[str, dict]:
        """Per strategy: its means over the steps, overwritten by the totals and ratios of totals
        (``speedup_vs_static``: static's total step time over this one's, on the same batches;
        ``x_lower_bound``, ``x_bound``: total step time over the sum of the steps' bounds), the
        per-step medians of those ratios beside them (``..._per_batch_median``), and every
        step's own figures (``per_batch``)."""
        out = {}
        base = self.steps.get("static") if "static" not in self.errors else None
        for name in self.config.strategies:
            if name in self.errors:
                out[name] = {"error": self.errors[name]}
                continue
            rows = self.steps.get(name, [])
            if not rows:
                continue
            res = means(rows)
            tot = totals(rows, base if base and len(base) == len(rows) else None)
            if "speedup" in tot:
                tot["speedup_vs_static"] = tot.pop("speedup")
                tot["speedup_vs_static_per_batch_median"] = tot.pop("speedup_per_batch_median")
            res.update(tot)
            res["per_batch"] = rows
            if self.notes.get(name):
                res["notes"] = self.notes[name]
            out[name] = res
        return out

    def to_json(self) -> dict:
        cfg = asdict(self.config)
        cfg["strategies"] = list(self.config.strategies)
        cfg["d_hdp"] = self.cluster.d_hdp
        cfg["gpus_per_node"] = self.cluster.gpus_per_node
        cfg["cost_model"] = asdict(self.cost)
        out = {"config": cfg, "results": self.results()}
        if self.dataset:
            out["dataset"] = self.dataset
        out["batches"] = [{"sequences": n, "longest": m, "tokens": t} for n, m, t in self.batch_stats]
        return out


NO_EXPERT_SLOTS = "megatron-dcp"  # its plans carry barriers, which EP slot alignment does not handle


def check_config(cfg: SimConfig) -> tuple[Cluster, CostModel]:
    model = ModelSpec.load(cfg.model)
    hw = HardwareSpec.load(cfg.hardware)
    cluster = Cluster(
        cfg.gpus, cfg.tp, cfg.pp, hw.gpus_per_node if cfg.gpus_per_node is None else cfg.gpus_per_node, cfg.ep
    )
    if cfg.ep > 1 and not model.num_experts:
        raise ConfigError(
            f"--ep {cfg.ep}: model {model.name!r} has no experts; "
            "expert parallelism needs a MoE model (e.g. mistral-8x7b)"
        )
    cost = CostModel.analytic(model, hw, tp=cfg.tp, pp=cfg.pp, dkv_bf16=cfg.dkv_bf16)
    if cfg.host_memory_per_gpu is not None:
        cost = cost.with_overrides(host_memory_bytes=float(cfg.host_memory_per_gpu))
    if cfg.capacity <= 0 or cfg.context <= 0 or cfg.global_batch_tokens <= 0:
        raise ConfigError("capacity, context and global batch tokens must be positive")
    if cfg.context < cfg.capacity:
        raise ConfigError(
            f"context {cfg.context} is smaller than the capacity {cfg.capacity}; the capacity is what one rank "
            "holds of a longer sequence, so give a context >= capacity"
        )
    if cfg.context > cfg.capacity * cluster.d_hdp:
        raise ConfigError(
            f"a {cfg.context}-token sequence does not fit on {cluster.d_hdp} HDP ranks of capacity {cfg.capacity}; "
            "raise the capacity or the GPU count, or lower the context"
        )
    if cfg.global_batch_tokens < cfg.context:
        raise ConfigError(
            f"--global-batch-tokens {format_size(cfg.global_batch_tokens)} "
            f"is smaller than --context {format_size(cfg.context)}: "
            "a context-long sequence could never be in a batch; raise --global-batch-tokens or lower --context"
        )
    if cfg.steps <= 0:
        raise ConfigError(f"--steps must be positive, got {cfg.steps}")
    if cfg.validate not in ("first", "all", "none"):
        raise ConfigError(f"--validate must be first, all or none, got {cfg.validate!r}")
    check_vpp(cfg.vpp, cfg.pp, cost.num_layers)
    dev_tree(cfg.megatron_dev)  # a named tree must hold the scheduler
    parse_strategies(",".join(cfg.strategies))
    if cfg.ep > 1 and NO_EXPERT_SLOTS in cfg.strategies:
        raise ConfigError(
            f"--ep {cfg.ep}: {NO_EXPERT_SLOTS} is not simulated with expert parallelism (its barrier-separated "
            "groups are not aligned into EP slots); drop it from --strategies"
        )
    return cluster, cost


def default_strategies(ep: int, model: str | None = None, megatron_dev: str | None = None) -> tuple[str, ...]:
    """Every strategy the simulator can cost at this EP size for ``model`` (the latent ring's
    only for a multi-latent attention model; Megatron's dev-branch dynamic CP where a tree
    of it is named, by ``megatron_dev`` or the environment)."""
    mla = model is not None and ModelSpec.load(model).is_mla
    dev = dev_tree(megatron_dev) is not None
    return tuple(
        n
        for n in STRATEGIES
        if not (ep > 1 and n == NO_EXPERT_SLOTS) and (mla or n not in LATENT_ONLY) and (dev or n not in NEEDS_DEV_TREE)
    )


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while one strategy plans and costs a step. A plan
    is ~10^6 small objects without reference cycles (the static mesh gives every member of a
    256-rank ring its piece of every sequence): the collector, started every few hundred
    allocations, would walk them again and again while they are built, and find nothing to
    free; their memory goes by reference counting as before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run(cfg: SimConfig, progress: bool = True) -> SimReport:
    cluster, cost = check_config(cfg)
    rng = np.random.default_rng(cfg.seed)
    pool = read_lengths_file(cfg.lengths_file) if cfg.lengths_file else None
    report = SimReport(config=cfg, cluster=cluster, cost=cost)
    batches = None
    if cfg.data_path:
        batches, report.dataset = training_batches(cfg.data_path, cfg.global_batch_tokens, cfg.context, cfg.seed)
    bar = tqdm(total=cfg.steps * len(cfg.strategies), disable=not progress, file=sys.stderr, unit="plan")
    for step in range(cfg.steps):
        if batches is not None:
            lengths = next(batches)
        elif pool is not None:
            lengths = lengths_from_file(pool, cfg.global_batch_tokens, cfg.context, rng)
        else:
            lengths = sample_lengths(cfg.dataset, cfg.global_batch_tokens, cfg.context, rng)
        report.batch_stats.append((len(lengths), max(lengths), sum(lengths)))
        x = StrategyInput(
            lengths, cluster, cost, cfg.capacity, cfg.context, cfg.pipeline_schedule, cfg.vpp, cfg.megatron_dev
        )
        this_step: dict[str, dict] = {}
        for name in cfg.strategies:
            bar.set_description(f"step {step + 1}/{cfg.steps} {name}")
            if name not in report.errors:
                try:
                    with collector_paused():
                        plan = make_plan(name, x)
                        if cfg.validate == "all" or (cfg.validate == "first" and step == 0):
                            plan.validate()
                        result = evaluate(plan, cluster, cost)
                except StrategyError as exc:
                    report.errors[name] = str(exc)
                except PlanError as exc:  # a strategy's plan that cannot run: its row says why, the others go on
                    report.errors[name] = f"its plan cannot run: {exc}"
                else:
                    this_step[name] = result.metrics()
                    if "est_time_max_s" in plan.meta:  # the planner's own estimate of the step
                        this_step[name]["planner_estimate_s"] = float(plan.meta["est_time_max_s"])
                    report.steps.setdefault(name, []).append(this_step[name])
                    for note in result.notes:
                        report.notes.setdefault(name, [])
                        if note not in report.notes[name]:
                            report.notes[name].append(note)
                    if step == 0:
                        report.timelines[name] = result.timeline
                        report.lower_bound_first = result.lower_bound
            bar.update(1)
    bar.close()
    return report
