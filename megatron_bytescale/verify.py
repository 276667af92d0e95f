"""``bytescale verify``: does HDP on N ranks train exactly like one rank?

Spawns N gloo processes running one training step of a tiny GPT (megatron-core GPTModel, our
ring attention) under the planner's HDP plan, runs the same global batch on one rank with
every sequence whole, and runs the static DP x CP mesh on the same batch with the same
attention code to measure its traffic. Prints and writes loss, gradient differences and P2P
bytes; exits non-zero when HDP and the reference differ beyond tolerance or the measured
traffic differs from the plan's prediction. Also a sanity check for users' own machines.

A multi-latent attention model (``--model tiny-mla``) runs the HDP step once per ring
transport, K and V then the latent (the same plan, ``Plan.with_ring_transport``): both must
match one rank, and each one's bytes its prediction.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .errors import BytescaleError
from .planner.contract import MicroBatch, Plan, whole_piece
from .planner.cost_model import FP32_BYTES, CostModel
from .planner.planner import PlannerConfig, plan_step
from .planner.ring_traffic import p2p_bytes_per_rank
from .planner.specs import HardwareSpec, ModelSpec
from .units import parse_size

# max |g_hdp - g_ref| relative to the largest reference gradient, and the loss's relative gap.
# fp32: reordered sums differ by rounding only (~1e-7 relative per op; 1e-5 leaves room for the
# few thousand ops of a step). bf16 (8-bit mantissa, unit roundoff 2^-8 = 3.9e-3): HDP splits a
# sequence's attention into ring blocks merged by log-sum-exp and reduces gradients in another
# order than the one-rank reference, so each bf16 rounding may land on the other side; a few
# roundings of relative size 2^-8 compound to a few percent on the largest gradient entry.
# (Measured on the tiny model, 2 ranks, lengths 700,300,45: 1.0e-2 on gradients, 3e-6 on the loss.)
TOLERANCES = {"fp32": {"grad": 1e-5, "loss": 1e-5}, "bf16": {"grad": 5e-2, "loss": 2e-3}}
GRAD_TOL = TOLERANCES["fp32"]["grad"]
LOSS_TOL = TOLERANCES["fp32"]["loss"]
DTYPES = ("fp32", "bf16")


def parse_lengths(text: str | None, path: str | None) -> list[int]:
    if (text is None) == (path is None):
        raise BytescaleError("give the batch as --lengths L1,L2,... or --lengths-file FILE (one of them)")
    if path is not None:
        from .data.workloads import read_lengths_file

        return [int(x) for x in read_lengths_file(path)]
    try:
        lengths = [parse_size(x, "sequence length") for x in text.split(",") if x.strip()]
    except BytescaleError as exc:
        raise BytescaleError(f"--lengths: {exc}") from None
    if not lengths:
        raise BytescaleError("--lengths is empty: give at least one sequence length")
    return lengths


def tokens_for(seed: int, vocab: int):
    """A deterministic token reader: every process draws the same tokens for a sequence."""

    def read(seq_id: int, start: int, stop: int) -> np.ndarray:
        return np.random.default_rng([seed, seq_id]).integers(0, vocab, size=stop)[start:stop]

    return read


def one_rank_plan(lengths: list[int], num_layers: int) -> Plan:
    ranks = (tuple(MicroBatch((whole_piece(i, s, 0),)) for i, s in enumerate(lengths)),)
    return Plan(1, max(lengths), num_layers, tuple(lengths), ranks, meta={"strategy": "one-rank"}).validate()


def with_offload_ratio(plan: Plan, ratio: float) -> Plan:
    """Offload at least ``ratio`` of every micro-batch that holds a share of a long (ring)
    sequence; a micro-batch the planner gave more (to fit its share) keeps its own."""
    ranks = tuple(
        tuple(replace(mb, offload_ratio=max(ratio, mb.offload_ratio)) if mb.ring is not None else mb for mb in mbs)
        for mbs in plan.ranks
    )
    return replace(plan, ranks=ranks)


def parse_two_level(text: str | None) -> tuple[int, int] | None:
    """``--two-level SEQ[:U]`` -> (sequence index, group size; default 2)."""
    if text is None:
        return None
    seq, _, u = text.partition(":")
    try:
        return int(seq), int(u) if u else 2
    except ValueError:
        raise BytescaleError(
            f"--two-level {text!r}: give SEQ or SEQ:U (a sequence index, a group size), e.g. 0:2"
        ) from None


def with_two_level(plan: Plan, seq_id: int, u: int, q_heads: int, kv_heads: int) -> Plan:
    """Run sequence ``seq_id``'s ring two-level with groups of ``u`` (and its micro-batch's
    other ring sequences with it: one micro-batch, one ring)."""
    if not 0 <= seq_id < len(plan.seq_lens):
        raise BytescaleError(
            f"--two-level: sequence {seq_id} is not in the batch of {len(plan.seq_lens)}; give an index "
            f"0..{len(plan.seq_lens) - 1}"
        )
    ring = plan.ring_sizes().get(seq_id, 1)
    if ring == 1:
        raise BytescaleError(
            f"--two-level: sequence {seq_id} ({plan.seq_lens[seq_id]} tokens) runs whole on one rank at capacity "
            f"{plan.capacity}; pick a sequence longer than the capacity (or lower --capacity)"
        )
    if u < 2 or ring % u:
        raise BytescaleError(
            f"--two-level: group size {u} must be >= 2 and divide sequence {seq_id}'s ring of {ring} ranks"
        )
    if q_heads % u or kv_heads % u:
        raise BytescaleError(
            f"--two-level: group size {u} must divide the {q_heads} query and {kv_heads} KV heads per TP rank "
            "(so the plan's byte prediction is exact)"
        )
    ranks = tuple(
        tuple(
            replace(mb, pieces=tuple(replace(p, heads_split=u) if p.is_distributed else p for p in mb.pieces))
            if seq_id in mb.distributed_seq_ids
            else mb
            for mb in mbs
        )
        for mbs in plan.ranks
    )
    return replace(plan, ranks=ranks)


def _rank_main(rank, world, model, tp, seed, plan_json, offload, dtype="fp32"):
    """One process: one HDP step of ``plan``; returns loss, gradients and measured traffic."""
    import torch
    from megatron.core import parallel_state

    from .megatron import local_run
    from .runtime.batch import StepBatch, build_micro_batch_data

    gpt, group = local_run.setup_model(
        model, tp=tp, seed=seed, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    )
    plan = Plan.from_json(plan_json)
    hdp = parallel_state.get_data_parallel_rank()
    read = tokens_for(seed, ModelSpec.load(model).vocab_size)
    step = StepBatch(plan, hdp, [build_micro_batch_data(mb, read) for mb in plan.micro_batches(hdp)])
    offloader = None
    if offload:
        from .runtime.offload import ActivationOffloader, transformer_layers

        # every saved tensor may move, however small: the check is that moving changes nothing
        offloader = ActivationOffloader(transformer_layers(gpt), min_tensor_bytes=0)
    result = local_run.run_step(step, gpt, group, offloader=offloader)
    out = {
        "loss": result.loss,
        "p2p_bytes": result.stats.p2p_bytes,
        "offloaded_bytes": result.stats.offloaded_bytes,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "label_tokens": result.global_tokens,
        "grads": {n: p.grad.detach().float().clone() for n, p in gpt.named_parameters()},
    }
    local_run.teardown()
    return out


def run_plan(
    plan: Plan, *, model: str, tp: int, seed: int, offload: bool = False, timeout_s: float = 600, dtype: str = "fp32"
) -> list[dict]:
    from .local_world import preload, run_local_world

    preload(["megatron.core.models.gpt.gpt_model", "megatron_bytescale.megatron.local_run"])
    return run_local_world(
        _rank_main, plan.num_ranks * tp, model, tp, seed, plan.to_json(), offload, dtype, timeout_s=timeout_s
    )


def grad_diffs(outs: list[dict], refs: list[dict]) -> tuple[float, float]:
    """Max absolute and relative gradient differences, comparing each rank with the reference
    rank of the same TP rank (TP shards line up)."""
    by_tp = {r["tp_rank"]: r["grads"] for r in refs}
    worst_abs = worst_rel = 0.0
    for o in outs:
        ref = by_tp[o["tp_rank"]]
        for name, g in o["grads"].items():
            diff = float((g - ref[name]).abs().max())
            scale = float(ref[name].abs().max())
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / scale if scale > 0 else diff)
    return worst_abs, worst_rel


def check_request(lengths: list[int], *, world_size: int, tp: int, offload_ratio: float | None, dtype: str) -> None:
    """verify's own flags, checked before any process starts."""
    from .local_world import check_world_size

    if tp < 1:
        raise BytescaleError(f"--tp {tp}: the tensor-parallel size must be at least 1")
    check_world_size(world_size)
    if world_size % tp:
        raise BytescaleError(f"--world-size {world_size} must be a positive multiple of --tp {tp}")
    if offload_ratio is not None and not (0.0 <= offload_ratio <= 1.0):  # also refuses nan
        raise BytescaleError(f"--offload-ratio must be in [0, 1], got {offload_ratio}")
    if dtype == "fp64":
        raise BytescaleError(
            "--dtype fp64 is not supported: ring attention merges blocks with an fp32 log-sum-exp and "
            "megatron-core's CPU layers run fp32/bf16; use --dtype fp32 (exact check) or bf16"
        )
    if dtype not in DTYPES:
        raise BytescaleError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if all(s <= 1 for s in lengths):
        raise BytescaleError(
            "no token carries a label: every sequence has 1 token (a token's label is the next token), so there "
            "is nothing to compare; give --lengths with at least one sequence of 2 or more tokens"
        )


def plan_hdp(
    lengths: list[int], *, ranks: int, capacity: int, spec: ModelSpec, tp: int, offload_ratio: float | None
) -> Plan:
    """The planner's HDP plan in verify's terms (its errors name verify's flags)."""
    cost = CostModel.analytic(spec, HardwareSpec.load("h100"), tp=tp)
    if offload_ratio is not None:
        # verify checks exactness, not speed: any ratio that makes a share fit is allowed,
        # whether or not an H100's PCIe link would hide its copy
        cost = cost.with_overrides(bw_d2h=float("inf"), bw_h2d=float("inf"))
    config = PlannerConfig(num_ranks=ranks, capacity=capacity, ranks_per_node=ranks, offload=offload_ratio is not None)
    try:
        plan = plan_step(lengths, config, cost)
    except BytescaleError as exc:
        if "capacity too small" not in str(exc):
            raise
        longest = max(lengths)
        hint = "raise --capacity or --world-size" + ("" if offload_ratio is not None else ", or pass --offload-ratio R")
        raise BytescaleError(
            f"--lengths: the {longest}-token sequence does not fit on {ranks} HDP ranks of --capacity {capacity}"
            f"{' even offloading' if offload_ratio is not None else ''}; {hint}"
        ) from None
    if offload_ratio is not None:
        plan = with_offload_ratio(plan, offload_ratio)
    return plan.validate()


def verify(
    lengths: list[int],
    *,
    world_size: int,
    capacity: int,
    seed: int = 0,
    model: str = "tiny",
    tp: int = 1,
    offload_ratio: float | None = None,
    dtype: str = "fp32",
    two_level: tuple[int, int] | None = None,
    progress=None,
) -> dict:
    """HDP's step against one rank's (and the static mesh's) on one batch. ``progress(line)``
    hears what starts next: each of the three runs starts its own gloo processes."""
    say = progress or (lambda line: None)
    check_request(lengths, world_size=world_size, tp=tp, offload_ratio=offload_ratio, dtype=dtype)
    ranks = world_size // tp
    spec = ModelSpec.load(model)
    plan = plan_hdp(lengths, ranks=ranks, capacity=capacity, spec=spec, tp=tp, offload_ratio=offload_ratio)
    if two_level is not None:
        q_heads, kv_heads = spec.num_attention_heads // tp, max(1, spec.num_query_groups // tp)
        plan = with_two_level(plan, *two_level, q_heads, kv_heads)
        plan.validate()
    from .sim.cluster import Cluster
    from .sim.static_cp import static_plan

    try:  # the static mesh never offloads: a batch that fits only by offloading has no static run
        static = static_plan(
            lengths,
            Cluster(gpus=world_size, tp=tp, pp=1, gpus_per_node=world_size),
            capacity,
            max(lengths),
            spec.num_layers,
        )
    except BytescaleError as exc:
        if offload_ratio is None:
            raise
        static, static_skipped = None, str(exc)
    else:
        static_skipped = None

    from .megatron.model import load_model

    model_spec, arch = load_model(model)
    widths = model_spec.ring_values_per_token(tp)  # per transport: values per token of a block
    attention_layers = spec.num_layers + (arch.mtp_num_layers or 0)  # an MTP depth runs one layer more
    if two_level is not None and "latent" in widths:
        raise BytescaleError(
            "--two-level with a multi-latent attention model: two-level rings carry K and V of one head dim in the "
            "plan's byte count; leave --two-level out"
        )
    total = len(widths) + 1 + (static is not None)
    runs = {}
    for i, transport in enumerate(widths, 1):
        what = f" ({transport} ring)" if len(widths) > 1 else ""
        say(f"[{i}/{total}] one step under HDP on {world_size} gloo ranks{what} (starting the processes) ...")
        runs[transport] = run_plan(
            plan.with_ring_transport(transport),
            model=model,
            tp=tp,
            seed=seed,
            offload=offload_ratio is not None,
            dtype=dtype,
        )
    say(f"[{len(widths) + 1}/{total}] the same batch on one rank, every sequence whole ...")
    ref = run_plan(one_rank_plan(lengths, spec.num_layers), model=model, tp=tp, seed=seed, dtype=dtype)
    mesh = None
    if static is not None:
        say(f"[{total}/{total}] the same batch on the static DP x CP mesh (CP = {static.meta['cp']}) ...")
        mesh = run_plan(static, model=model, tp=tp, seed=seed, dtype=dtype)

    # blocks travel in the activations' dtype (fp32 on CPU), their gradient accumulators always in fp32
    act = FP32_BYTES if dtype == "fp32" else 2
    q_bytes = spec.num_attention_heads // tp * spec.kv_channels * act
    per_transport = {}
    for transport, hdp in runs.items():
        predicted = p2p_bytes_per_rank(
            plan,
            widths[transport] * act,
            widths[transport] * FP32_BYTES,
            attention_layers,
            q_bytes_per_token=q_bytes,
        )
        measured = [o["p2p_bytes"] for o in hdp[::tp]]
        max_abs, max_rel = grad_diffs(hdp, ref)
        per_transport[transport] = {
            "loss_hdp": hdp[0]["loss"],
            "max_abs_grad_diff": max_abs,
            "max_rel_grad_diff": max_rel,
            "p2p_bytes": int(sum(measured) * tp),
            "p2p_bytes_predicted": int(sum(predicted) * tp),
            "values_per_token": widths[transport],
        }
    hdp, first = runs["kv"], per_transport["kv"]
    sizes = plan.ring_sizes()
    return {
        "world_size": world_size,
        "tp": tp,
        "dtype": dtype,
        "label_tokens": ref[0]["label_tokens"],
        "capacity": capacity,
        "lengths": lengths,
        "loss_ref": ref[0]["loss"],
        "loss_hdp": first["loss_hdp"],
        "loss_static": mesh[0]["loss"] if mesh else None,
        "max_abs_grad_diff": first["max_abs_grad_diff"],
        "max_rel_grad_diff": first["max_rel_grad_diff"],
        "static_max_rel_grad_diff": grad_diffs(mesh, ref)[1] if mesh else None,
        "offload_ratios": sorted({mb.offload_ratio for mbs in plan.ranks for mb in mbs if mb.offload_ratio > 0}),
        "p2p_bytes": first["p2p_bytes"],
        "p2p_bytes_predicted": first["p2p_bytes_predicted"],
        # a multi-latent attention model: the HDP run of each ring transport (the keys above are "kv"'s)
        "ring_transports": per_transport if len(per_transport) > 1 else None,
        "p2p_bytes_static": int(sum(o["p2p_bytes"] for o in mesh)) if mesh else None,
        "offloaded_bytes": int(sum(o["offloaded_bytes"] for o in hdp)),
        "ranks_per_sequence": [sizes[i] for i in range(len(lengths))],
        "static_cp": static.meta.get("cp") if static else None,
        "static_skipped": static_skipped,
        "two_level": None if two_level is None else {"seq": two_level[0], "heads_split": two_level[1]},
    }


def passed(report: dict) -> list[str]:
    """The checks that failed (empty: all good)."""
    failures = []
    tol = TOLERANCES[report.get("dtype", "fp32")]
    if report.get("label_tokens", 1) <= 0:
        failures.append("no token carries a label: the loss is 0 on both sides and nothing was compared")
    for name, key in (("HDP", "loss_hdp"), ("static DPxCP", "loss_static")):
        if report.get(key) is not None and abs(report[key] - report["loss_ref"]) > tol["loss"] * max(
            1.0, abs(report["loss_ref"])
        ):
            failures.append(f"loss differs: {name} {report[key]:.8f} vs one rank {report['loss_ref']:.8f}")
    for name, key in (("HDP", "max_rel_grad_diff"), ("static DPxCP", "static_max_rel_grad_diff")):
        if report.get(key) is not None and report[key] > tol["grad"]:
            failures.append(f"{name} gradients differ: max relative difference {report[key]:.2e} > {tol['grad']:.0e}")
    if report["p2p_bytes"] != report["p2p_bytes_predicted"]:
        failures.append(
            f"P2P bytes {report['p2p_bytes']} differ from the plan's prediction {report['p2p_bytes_predicted']}"
        )
    for transport, run in (report.get("ring_transports") or {}).items():
        if transport == "kv":  # the keys above
            continue
        if abs(run["loss_hdp"] - report["loss_ref"]) > tol["loss"] * max(1.0, abs(report["loss_ref"])):
            failures.append(f"loss differs: HDP ({transport} ring) {run['loss_hdp']:.8f} vs {report['loss_ref']:.8f}")
        if run["max_rel_grad_diff"] > tol["grad"]:
            failures.append(
                f"HDP ({transport} ring) gradients differ: max relative difference {run['max_rel_grad_diff']:.2e}"
            )
        if run["p2p_bytes"] != run["p2p_bytes_predicted"]:
            failures.append(
                f"P2P bytes of the {transport} ring {run['p2p_bytes']} differ from the prediction "
                f"{run['p2p_bytes_predicted']}"
            )
    return failures
