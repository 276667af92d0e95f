"""Megatron's dynamic context parallelism as its development branch schedules it, as a Plan.

The assignment is megatron-core's own: ``DefaultDynamicCPScheduler.get_groups_and_subsamples``
(``megatron/core/datasets/data_schedule.py`` on Megatron-LM's dev branch), imported from a
Megatron-LM tree the user names (``--megatron-dev PATH`` or ``$BYTESCALE_MEGATRON_DEV``), never
copied. Its megatron-core differs from the installed one, so the scheduler runs in a worker
process with that tree first on its path, started once per run and fed every step's lengths.

Called as ``wrap_data_iterator`` calls it: ``max_seqlen_per_dp_cp_rank`` = our capacity, the
DP x CP ranks as one flat group, ``min_cp_size`` 1 (Megatron's default), and with virtual
pipeline stages ``microbatch_group_size_per_vp_stage`` = PP (Megatron's default), which makes
it split groups until their count is a multiple of it. Each returned group is one micro-batch
on every rank: the samples a rank lists are packed into it, and the ranks sharing a sample form
its CP group (each rank is in one CP group per micro-batch, and every sample the group holds is
split over all of it). The micro-batches then run through Megatron's ordinary schedules, so:

* one Plan micro-batch per (rank, group): the pieces of its samples, each zigzag-split over the
  CP group (ascending rank order), or whole where the group is one rank;
* every rank runs the same number of micro-batches in the same order, with no barrier: 1F1B
  with pipelines, the interleaved order with virtual stages; with expert parallelism the
  members of an EP group run micro-batch k together (the timeline aligns their slots);
* no offloading.

A sample shorter than its CP group (the scheduler may widen a group to fill idle ranks) is
costed whole on the group's first rank: the runtime pads it to ``2 * CP`` tokens and splits
that, a few tokens per rank either way.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from ..planner.contract import MicroBatch, Plan, ring_pieces, whole_piece
from .cluster import Cluster
from .static_cp import StrategyError

DEV_TREE_ENV = "BYTESCALE_MEGATRON_DEV"
SCHEDULER_FILE = Path("megatron/core/datasets/data_schedule.py")

# the worker: the dev tree's megatron-core first on the path (megatron_bytescale first for its
# triton stand-ins, which megatron.core needs on a machine without triton), then one JSON
# request per line: {"lengths", "capacity", "ranks", "group"} -> {"groups", "wall"} or {"error"}
_WORKER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import megatron_bytescale
from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        s = DefaultDynamicCPScheduler(req["capacity"], 1, req["ranks"], req["group"], min_cp_size=1)
        t0 = time.perf_counter()
        groups = s.get_groups_and_subsamples([(i, n) for i, n in enumerate(req["lengths"])])
        out = {"groups": groups, "wall": time.perf_counter() - t0}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}".strip()}
    print(json.dumps(out), flush=True)
"""


def dev_tree(path: str | None) -> Path | None:
    """The Megatron-LM dev tree to import the scheduler from (``path``, else the environment);
    None if neither names one. ConfigError if the named folder has no such scheduler."""
    path = path or os.environ.get(DEV_TREE_ENV)
    if not path:
        return None
    tree = Path(path)
    if not (tree / SCHEDULER_FILE).is_file() or "DefaultDynamicCPScheduler" not in (tree / SCHEDULER_FILE).read_text(
        encoding="utf-8", errors="replace"
    ):
        raise ConfigError(
            f"--megatron-dev {path}: no {SCHEDULER_FILE} with DefaultDynamicCPScheduler there; give a Megatron-LM "
            "tree of the dev branch (e.g. one at d48bd6b)"
        )
    return tree


class _Worker:
    def __init__(self, tree: Path):
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the worker's stderr, closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(tree)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.tree = tree
        self._read("starting")

    def _read(self, what: str) -> dict:
        for line in self.proc.stdout:  # the first JSON object: what megatron-core prints on import is not
            if line.startswith("{"):
                return json.loads(line)
        self.log.seek(0)
        last = [ln for ln in self.log.read().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise StrategyError(
            f"megatron-dcp-dev: the scheduler of {self.tree} failed {what}: {last[0]}; check that the tree "
            "imports with this Python (torch, megatron-core's dependencies)"
        )

    def schedule(self, lengths: Sequence[int], capacity: int, ranks: int, group: int | None) -> dict:
        request = {"lengths": [int(s) for s in lengths], "capacity": capacity, "ranks": ranks, "group": group}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read("on a batch")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_workers: dict[Path, _Worker] = {}


def _worker(tree: Path) -> _Worker:
    w = _workers.get(tree)
    if w is None or w.proc.poll() is not None:
        print(
            f"megatron-dcp-dev: starting Megatron's dev scheduler from {tree} (imports megatron-core) ...",
            file=sys.stderr,
            flush=True,
        )
        w = _workers[tree] = _Worker(tree)
    return w


@atexit.register
def close_workers() -> None:
    """Stop every scheduler worker this process started."""
    for w in _workers.values():
        w.close()
    _workers.clear()


def dev_groups(seq_lens: Sequence[int], d_hdp: int, capacity: int, tree: Path, vp_group: int | None):
    """Run the dev branch's DefaultDynamicCPScheduler: (sample id groups, wall seconds)."""
    out = _worker(tree).schedule(seq_lens, capacity, d_hdp, vp_group)
    if "error" in out:
        raise StrategyError(
            f"megatron-dcp-dev: Megatron's DefaultDynamicCPScheduler failed on this batch ({out['error']}) with "
            f"{d_hdp} DP x CP ranks and max_seqlen_per_dp_cp_rank={capacity}"
        )
    return out["groups"], out["wall"]


def megatron_dcp_dev_plan(
    seq_lens: Sequence[int], cluster: Cluster, capacity: int, num_layers: int, tree: Path, virtual_stages: int = 1
) -> Plan:
    d = cluster.d_hdp
    vp_group = cluster.pp if virtual_stages > 1 else None  # microbatch_group_size_per_vp_stage
    groups, wall = dev_groups(seq_lens, d, capacity, tree, vp_group)
    ranks: list[list[MicroBatch]] = [[] for _ in range(d)]
    sizes: Counter = Counter()
    short = 0
    for group in groups:
        holders: dict[int, list[int]] = {}
        for r, ids in enumerate(group):
            for sid in ids:
                holders.setdefault(int(sid), []).append(r)
        pieces: list[list] = [[] for _ in range(d)]
        for sid, members in holders.items():
            s, ring = int(seq_lens[sid]), tuple(members)
            sizes[len(ring)] += 1
            if len(ring) == 1 or s < len(ring):
                short += len(ring) > 1
                pieces[ring[0]].append(whole_piece(sid, s, ring[0]))
            else:
                for r, p in zip(ring, ring_pieces(sid, s, ring)):
                    pieces[r].append(p)
        for r in range(d):
            if pieces[r]:
                ranks[r].append(MicroBatch(tuple(pieces[r])))
    notes = []
    # the scheduler packs a CP group up to capacity counting s / CP tokens per member; whole
    # tokens per member (the runtime's padded split, our zigzag) can pass it by a few
    held = max((sum(e - b for p in mb.pieces for b, e in p.ranges) for mbs in ranks for mb in mbs), default=0)
    if held > capacity:
        notes.append(
            "packed CP groups can hold a few tokens per rank over the capacity (the scheduler counts s / CP "
            "tokens per member, a member holds whole tokens); costed as they are"
        )
    if short:
        notes.append(f"{short} samples shorter than their CP group costed whole on its first rank (padded at runtime)")
    return Plan(
        num_ranks=d,
        capacity=max(capacity, held),
        num_layers=num_layers,
        seq_lens=tuple(int(s) for s in seq_lens),
        ranks=tuple(tuple(mbs) for mbs in ranks),
        meta={
            "strategy": "megatron-dcp-dev",
            "plan_time_s": wall,
            "groups": len(groups),
            "cp_sizes": {str(k): v for k, v in sorted(sizes.items())},
            "notes": notes,
        },
    )
