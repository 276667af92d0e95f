"""``bytescale dataloader-bench``: planning and delivery time per step, and bytes read.

Runs K steps for N ranks in this one process, the ranks one after another:

* ``--mode local``: the step is planned once (every rank would compute the same plan in
  parallel, so one planning time is the step's), then each rank's micro-batches are read
  from the indexed dataset; a step's delivery time is the slowest rank's.
* ``--mode ray``: the scheduler actor plans ahead (its planning time is reported, though it
  overlaps training); each rank pulls its shards from the server actors; a step's delivery
  time is the longest any rank waited.

Output (printed, and with ``--json OUT`` written): ``samples_digest`` (hash of every
(rank, step, micro-batch, sequence, document, token range) delivery and its tokens - equal
across modes for the same seed), ``plan_s_median``, ``delivery_s_median``,
``bytes_read_per_rank_max``, ``bytes_read_all_ranks``, and the every-rank-reads-everything
baseline (``bytes_if_every_rank_reads_all``), and the step's training time under
``--model``/``--hardware`` as the simulator costs the delivered plan (``sim_step_s_median``)
and as the planner estimates it, each with its ratio to planning + delivery.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from ..errors import ConfigError

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron_bytescale"


def default_dataset() -> str:
    """A corpus of the installed packages, built on first use."""
    from ..data.indexed import DocumentDataset
    from ..data.prepare import prepare

    prefix = DEFAULT_CACHE / "site-packages-corpus"
    try:
        DocumentDataset(prefix)
        return str(prefix)
    except ConfigError:
        pass
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        probe = prefix.parent / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot build the default corpus in {prefix.parent} ({exc.strerror or exc}): "
            "pass --data PREFIX (build one with `bytescale prepare-data`) or set XDG_CACHE_HOME to a writable folder"
        ) from None
    print(f"building the default corpus at {prefix} (once) ...", flush=True)
    args = argparse.Namespace(
        output=str(prefix),
        site_packages="",
        repos=None,
        jsonl=None,
        text_files=None,
        text_lines=None,
        packages=None,
        json_key="text",
        vocab_size=512,
        max_file_bytes=4 << 20,
        quiet=True,
    )
    summary = prepare(args)
    print(f"  {summary['documents']} documents, {summary['tokens']:,} tokens", flush=True)
    return str(prefix)


def run_bench(args) -> dict:
    from ..data.loader_factory import make_loader
    from ..data.planning import SamplesDigest
    from ..planner.cost_model import CostModel
    from ..planner.planner import PlannerConfig
    from ..planner.specs import HardwareSpec, ModelSpec

    if args.ranks < 1 or args.steps < 1:
        raise ConfigError(f"--ranks and --steps must be positive, got {args.ranks} and {args.steps}")
    if args.mode == "ray" and args.address:  # before the data: a dead cluster is a one-line error in seconds
        from ..data.ray_loader import check_reachable

        check_reachable(args.address)
    data = args.data or default_dataset()
    # Defaults shaped like the paper's runs: each rank runs a few micro-batches per step, and
    # the longest samples span half the ranks.
    step_tokens = args.step_tokens or 4 * args.ranks * args.capacity
    context = args.context_length or max(1, args.ranks * args.capacity // 2)
    config = PlannerConfig(num_ranks=args.ranks, capacity=args.capacity, ranks_per_node=args.ranks_per_node)
    cost = CostModel.analytic(ModelSpec.load(args.model), HardwareSpec.load(args.hardware))
    common = dict(step_tokens=step_tokens, context_length=context, seed=args.seed, cost=cost)
    if args.mode == "ray":
        common.update(num_servers=args.servers, lookahead=args.lookahead, address=args.address)
    loader = make_loader(args.mode, data, config, **common)

    from ..data.indexed import DocumentDataset

    itemsize = DocumentDataset(data).itemsize
    digest = SamplesDigest()
    from ..sim.cluster import Cluster
    from ..sim.timeline import simulate

    cluster = Cluster(args.ranks, gpus_per_node=min(args.ranks_per_node, args.ranks))
    plan_s, delivery_s, step_token_counts, step_sample_counts, est_step_s, sim_step_s = [], [], [], [], [], []
    per_rank = [0] * args.ranks
    t_start = time.perf_counter()
    from tqdm import tqdm

    try:
        for _ in tqdm(range(args.steps), desc=f"{args.mode} loader", unit="step", file=sys.stderr, delay=2.0):
            if args.mode == "local":  # planned once: every rank computes this same plan in parallel
                t0 = time.perf_counter()
                loader.step_plan()
                plan_s.append(time.perf_counter() - t0)
            waits = []
            for rank in range(args.ranks):
                batch = loader.batch(rank)
                digest.add(batch)
                per_rank[rank] += batch.bytes_read
                waits.append(batch.delivery_s)
            if args.mode == "ray":
                plan_s.append(batch.plan_s)  # measured in the scheduler, ahead of time
            delivery_s.append(max(waits))  # ranks run in parallel: the slowest one counts
            step_token_counts.append(loader.step_plan().tokens)
            step_sample_counts.append(len(loader.step_plan().samples))
            sim_step_s.append(simulate(loader.step_plan().plan, cluster, cost).step_time)
            est = loader.step_plan().plan.meta.get("est_time_max_s")
            if est is not None:
                est_step_s.append(float(est))
            loader.advance()
    finally:
        loader.close()
    total_step_bytes = sum(step_token_counts) * itemsize
    result = {
        "mode": args.mode,
        "data": data,
        "ranks": args.ranks,
        "steps": args.steps,
        "seed": args.seed,
        "capacity": args.capacity,
        "step_tokens": step_tokens,
        "context_length": context,
        "samples_digest": digest.hexdigest(),
        "plan_s_median": statistics.median(plan_s),
        "plan_s_max": max(plan_s),
        "delivery_s_median": statistics.median(delivery_s),
        "delivery_s_max": max(delivery_s),
        "tokens_per_step_median": statistics.median(step_token_counts),
        "samples_per_step_median": statistics.median(step_sample_counts),
        "bytes_read_per_rank_max": max(per_rank),
        "bytes_read_all_ranks": sum(per_rank),
        "bytes_if_every_rank_reads_all": args.ranks * total_step_bytes,
        "read_share_per_rank_max": max(per_rank) / total_step_bytes,
        "wall_s": time.perf_counter() - t_start,
        "sim_step_s_median": statistics.median(sim_step_s),
    }
    # loading must hide far inside the step's training time (goal: at least 10x smaller)
    result["sim_step_s_over_plan_plus_delivery"] = result["sim_step_s_median"] / (
        result["plan_s_median"] + result["delivery_s_median"]
    )
    if est_step_s:
        est = statistics.median(est_step_s)
        result["planner_est_step_s_median"] = est
        result["step_s_over_plan_plus_delivery"] = est / (result["plan_s_median"] + result["delivery_s_median"])
    return result
