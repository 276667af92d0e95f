"""Remote data loading on Ray (design 2.7): servers read, one scheduler plans, ranks pull.

* :class:`DocumentServer` actors (``num_servers``) each own the documents ``d`` with
  ``d % num_servers == k``: they open the indexed dataset, publish their documents' lengths
  (metadata, from the index only) and serve token-range reads. They hold no state that a
  restart could lose, so Ray restarts a dead server (``max_restarts``) and retries the reads
  that were in flight (``max_task_retries``): nothing is lost and nothing is read twice into
  the batch.
* One :class:`PlanScheduler` actor gathers the lengths, and a planning thread inside it
  computes the next ``lookahead`` steps ahead of the furthest step any rank has asked for,
  so planning overlaps training. It keeps the start position of every step it has planned,
  so any recent step can be re-planned exactly (plans are deterministic) after eviction.
  A scheduler that dies is a clear error on the ranks (``max_restarts=0``: its lookahead is
  not worth a silent restart; resume from the checkpointed loader state instead).
* Each training rank (:class:`RayDataLoader`) asks the scheduler for the step's plan,
  pulls only its own token ranges from the servers that own those documents, and builds its
  ``MicroBatchData`` list locally; the next step is prefetched in a background thread.

Every ``ray.get`` has a timeout (``BYTESCALE_RAY_TIMEOUT_S``, default 120 s); a silent actor
becomes a ``BytescaleError`` naming it. The scheduler's first plan, which also compiles the
planner's kernels on a machine that has not compiled them yet, is waited for before that
deadline counts, under the planning deadline (``BYTESCALE_PLAN_TIMEOUT_S``, default 600 s) and
with a line saying what is waited for.

The actors die with the job, also where Ray cannot end them (its GCS died, so no owner's death
reaches the actors): each watches the process that created it when it runs on the same node,
and every actor ends itself when no loader has called it for ``LEASE_S``
(``BYTESCALE_RAY_LEASE_S``, default 60 s); each loader renews the lease from a thread.

Ranks in separate processes share the actors by passing the same ``name`` (and the same
settings, ``num_servers`` included). Named actors live as long as the process that created
them: create the loader once in the launcher (or on rank 0 before the others attach), and
close it there; ranks call ``close(kill_actors=False)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import OrderedDict, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..errors import BytescaleError, ConfigError
from .documents import StreamDocuments
from .indexed import DocumentDataset, dataset_prefix
from .loader import StepLoader
from .planning import PlanFn, StepBatch, StepPlan, StepPlanner, default_plan_fn, deliver, rank_token_ranges
from .sampler import GlobalBatchSampler, Position, loader_state, restore_state

DEFAULT_TIMEOUT_S = float(os.environ.get("BYTESCALE_RAY_TIMEOUT_S", "120"))
PLAN_TIMEOUT_S = float(os.environ.get("BYTESCALE_PLAN_TIMEOUT_S", "600"))  # the first plan: kernels compile
LEASE_S = float(os.environ.get("BYTESCALE_RAY_LEASE_S", "60"))
SAY_AFTER_S = 10.0
NAMESPACE = "megatron_bytescale"  # named loaders live here, visible to every job on the cluster
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


CONNECT_TIMEOUT_S = 10.0  # a cluster head that does not accept a TCP connection by then is not there
ANSWER_TIMEOUT_S = 5.0  # a gRPC server answers the HTTP/2 preface at once; Ray's own wait is ~40 s
# The HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113 3.4): a Ray head's
# GCS is a gRPC server and answers with its own SETTINGS frame (type 4) first
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS_FRAME = 4


def _why_not_grpc(sock, timeout_s: float) -> str | None:
    """None when the server on ``sock`` answers the HTTP/2 preface with a SETTINGS frame, as
    every gRPC server does; otherwise what it did instead."""

    sock.settimeout(timeout_s)
    header = b""
    try:
        sock.sendall(_HTTP2_PREFACE)
        while len(header) < 9:  # one frame header: length (3), type (1), flags (1), stream (4)
            chunk = sock.recv(9 - len(header))
            if not chunk:
                return "it closed the connection without an HTTP/2 answer"
            header += chunk
    except TimeoutError:
        return f"no HTTP/2 answer within {timeout_s:.0f} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    if header[3] != _SETTINGS_FRAME:
        return f"it answered {header[:9]!r}, not HTTP/2"
    return None


def check_reachable(
    address: str, timeout_s: float = CONNECT_TIMEOUT_S, answer_timeout_s: float = ANSWER_TIMEOUT_S
) -> None:
    """Fail fast, naming the address, when nothing listens at a ``host:port`` Ray address
    (``ray.init`` itself retries for minutes with only warnings), or when what listens is not
    a gRPC server, so not a Ray head (``ray.init`` would wait ~40 s for its GCS). ``auto`` and
    ``ray://`` go to Ray; with ``RAY_USE_TLS`` the connection starts with TLS, so only TCP is probed."""
    import socket

    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"--address {address!r}: give the Ray head as HOST:PORT (e.g. 10.0.0.1:6379) or 'auto'")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ConfigError(
            f"--address {address}: no Ray cluster answers there ({why} after at most {timeout_s:.0f} s); "
            "start one with `ray start --head` or omit --address to start a local one"
        ) from None
    with sock:
        tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
        why = None if tls else _why_not_grpc(sock, answer_timeout_s)
    if why:
        raise ConfigError(
            f"--address {address}: something listens there but it is not a Ray head ({why}); give the "
            "head's GCS address that `ray start --head` prints (port 6379 by default), or omit --address"
        )


def token_refused(address: str) -> str:
    return (
        f"--address {address}: the Ray head refuses this process's authentication token (the cluster runs with "
        "RAY_AUTH_MODE=token): set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the "
        "head's token, the one `ray start --head` was given"
    )


@contextlib.contextmanager
def _stderr_silenced():
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def check_token(address: str) -> None:
    """Fail fast when the head at ``address`` refuses this process's token (a cluster started with
    RAY_AUTH_MODE=token): ``ray.init`` would log InvalidAuthToken warnings for ~20 s and then report a
    connection failure. Ray's own GCS client sends what ``ray.init`` would send and is refused in a
    second; any other failure is left to ``ray.init``."""
    if address == "auto" or "://" in address:
        return
    try:
        from ray._raylet import GcsClient
    except ImportError:  # a Ray without this client: ray.init reports it
        return
    try:
        with _stderr_silenced():  # Ray's C++ client logs the refusal too (a glog line on fd 2)
            GcsClient(address=address)
    except ray.exceptions.AuthenticationError:
        raise ConfigError(token_refused(address)) from None
    except Exception:  # noqa: BLE001 - not a token problem: ray.init names it
        return


def init_ray(address: str | None = None, num_cpus: int = 2, object_store_memory: int | None = 256 << 20) -> None:
    """Attach to the cluster at ``address``, or start a small local Ray instance (no
    dashboard); a no-op when Ray is already initialised. Local workers get this project on
    their ``PYTHONPATH`` so they can import it without an install."""
    if ray.is_initialized():
        return
    if address:
        check_reachable(address)
        check_token(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ray.exceptions.AuthenticationError:
            raise ConfigError(token_refused(address)) from None
        except ConnectionError as exc:  # something listens there, but it is not a Ray head
            raise ConfigError(f"--address {address}: {exc}; is it the Ray head's GCS port (default 6379)?") from None
        return
    path = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    # "local": a new instance even where /tmp/ray/ray_current_cluster names another cluster
    # (left by an earlier `ray start` on this machine), which Ray would otherwise try to join
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_memory,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
        logging_level=logging.WARNING,
    )


# --------------------------------------------------------------------------- actors
def owner() -> tuple[str, int]:
    """(host, pid) of this process: what an actor it creates watches."""
    import socket

    return socket.gethostname(), os.getpid()


class _Lease:
    """In an actor: end this process when the process that created it (``owner``, on the same
    node) is gone, or when no loader has called for ``lease_s``. Ray ends an actor whose owner
    died, but only while its GCS lives."""

    def __init__(self, owner: tuple[str, int] | None, lease_s: float):
        import socket

        self.last = time.monotonic()
        self._pid = owner[1] if owner and owner[0] == socket.gethostname() else None
        self._lease_s = lease_s
        threading.Thread(target=self._watch, name="bytescale-lease", daemon=True).start()

    def renew(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        from ..process_lifetime import _alive

        while True:
            time.sleep(min(1.0, self._lease_s / 4))
            if (self._pid is not None and not _alive(self._pid)) or time.monotonic() - self.last > self._lease_s:
                os._exit(0)


class DocumentServer:
    """Reads the documents of one shard. Stateless beyond the open dataset."""

    def __init__(
        self,
        data_path,
        vocab_size: int | None,
        shard: int,
        num_shards: int,
        owner: tuple[str, int] | None = None,
        lease_s: float = LEASE_S,
    ):
        # a prefix, or a split of blended or mock documents (documents.StreamDocuments, pickled)
        self.dataset = data_path if isinstance(data_path, StreamDocuments) else DocumentDataset(data_path, vocab_size)
        self.shard, self.num_shards = shard, num_shards
        self.doc_ids = np.arange(shard, len(self.dataset.lengths), num_shards, dtype=np.int64)
        self._lease = _Lease(owner, lease_s)  # from here on: no loader can call before the constructor ends

    def metadata(self) -> tuple[np.ndarray, np.ndarray]:
        """(document ids, their lengths) of this shard."""
        return self.doc_ids, self.dataset.lengths[self.doc_ids]

    def keepalive(self) -> None:
        self._lease.renew()

    def read(self, ranges: list[tuple[int, int, int]]) -> list[np.ndarray]:
        self._lease.renew()
        for doc, _, _ in ranges:
            if doc % self.num_shards != self.shard:
                raise ConfigError(f"document {doc} belongs to server {doc % self.num_shards}, not {self.shard}")
        return [np.array(self.dataset.read(d, a, b)) for d, a, b in ranges]

    def pid(self) -> int:
        return os.getpid()


class PlanScheduler:
    """Plans steps ahead in a background thread; answers ``step_plan(step)`` for any rank.

    Runs as a threaded Ray actor (``max_concurrency``), so ranks waiting for a step do not
    block each other; also usable in-process (``lengths=...``) for tests."""

    def __init__(
        self,
        servers=(),
        *,
        step_tokens,
        context_length,
        seed,
        plan_fn,
        num_ranks,
        lookahead,
        retain,
        timeout_s,
        lengths=None,
        sampler=None,
        owner=None,
        lease_s=LEASE_S,
    ):
        if sampler is not None:  # a blend's (or a split's) sampler, built where the stream was opened
            lengths = sampler.lengths
        elif lengths is None:  # the servers publish their documents' lengths
            parts = ray.get([s.metadata.remote() for s in servers], timeout=timeout_s)
            lengths = np.zeros(sum(len(ids) for ids, _ in parts), dtype=np.int64)
            for ids, lens in parts:
                lengths[ids] = lens
        self.sampler = sampler or GlobalBatchSampler(
            lengths, step_tokens=step_tokens, context_length=context_length, seed=seed
        )
        self.planner = StepPlanner(self.sampler, plan_fn, num_ranks)
        self.lookahead, self.retain = max(1, lookahead), max(1, retain)
        self._cond = threading.Condition()
        self._plans: OrderedDict[int, StepPlan] = OrderedDict()
        self._starts: dict[int, Position] = {0: self.sampler.start()}  # start of every step known
        self._base = 0  # earliest step with a known start
        self._frontier = 0  # next step the thread plans
        self._wanted = self.lookahead - 1  # plan up to here
        self._error: BaseException | None = None
        self._generation = 0
        self._stop = False
        self._thread = threading.Thread(target=self._plan_loop, name="plan-ahead", daemon=True)
        self._thread.start()
        # from here on (no loader can call before the constructor ends); None: in-process (tests)
        self._lease = _Lease(owner, lease_s) if owner is not None else None

    def fingerprint(self) -> dict:
        return self.sampler.fingerprint()

    def keepalive(self) -> None:
        if self._lease is not None:
            self._lease.renew()

    def ready(self, timeout_s: float) -> dict:
        """The fingerprint, once the first step this scheduler plans is planned (a first plan on a
        machine also compiles the planner's kernels). Raises the planning error, or TimeoutError."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._plans and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the scheduler's first plan took more than {timeout_s:g} s")
                self._cond.wait(remaining)
            if self._error is not None:
                raise self._error
        return self.fingerprint()

    def _plan_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._frontier > self._wanted or self._error is not None):
                    self._cond.wait()
                if self._stop:
                    return
                step, gen = self._frontier, self._generation
                start = self._starts[step]
            try:
                sp = self.planner.plan(step, start)
            except BaseException as exc:  # surfaced to the rank that waits for this step
                with self._cond:
                    if gen == self._generation:
                        self._error = exc
                        self._cond.notify_all()
                continue
            with self._cond:
                if gen != self._generation:
                    continue  # a reset happened while planning
                self._plans[step] = sp
                self._starts[step + 1] = sp.end
                self._frontier = step + 1
                while len(self._plans) > self.lookahead + self.retain:
                    self._plans.popitem(last=False)
                self._cond.notify_all()

    def step_plan(self, step: int, timeout_s: float) -> StepPlan:
        self.keepalive()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if step < self._base:
                raise ConfigError(
                    f"step {step} is before the loader's restored position (step {self._base}); "
                    "load the matching loader state first"
                )
            if step + self.lookahead > self._wanted:
                self._wanted = step + self.lookahead
                self._cond.notify_all()
            while step not in self._plans:
                if step < self._frontier:  # planned before and evicted: re-plan, deterministic
                    start = self._starts[step]
                    break
                if self._error is not None:
                    raise self._error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the scheduler did not plan step {step} within {timeout_s:g}s")
                self._cond.wait(remaining)
            else:
                return self._plans[step]
        return self.planner.plan(step, start)

    def reset(self, step: int, position: dict) -> None:
        """Continue from (step, position): a restored checkpoint."""
        pos = self.sampler.position_type.from_dict(position)
        self.sampler.check_position(pos)
        with self._cond:
            if self._starts.get(step) == pos:
                return  # already on this stream (another rank restored the same state)
            self._generation += 1
            self._plans.clear()
            self._starts = {step: pos}
            self._base = self._frontier = step
            self._wanted = step + self.lookahead - 1
            self._error = None
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return {"frontier": self._frontier, "cached": sorted(self._plans), "wanted": self._wanted}

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()


# --------------------------------------------------------------------------- client
class RayDataLoader(StepLoader):
    """One training rank's view of the remote dataloader (same API as LocalDataLoader)."""

    def __init__(
        self,
        data_path: str | Path,
        planner_config=None,
        *,
        step_tokens: int,
        context_length: int,
        seed: int = 0,
        rank: int | None = None,
        plan_fn: PlanFn | None = None,
        cost=None,
        vocab_size: int | None = None,
        num_servers: int = 2,
        lookahead: int = 4,
        retain: int = 8,
        name: str | None = None,
        address: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        server_max_restarts: int = 4,
        prefetch: bool = True,
    ):
        if plan_fn is None and planner_config is None:
            raise ConfigError("give the loader a PlannerConfig (or a plan_fn) so it can plan steps")
        if num_servers < 1:
            raise ConfigError(f"num_servers must be at least 1, got {num_servers}")
        sampler = None
        if isinstance(data_path, StreamDocuments):  # opened here (bad files refused here), pickled to the servers
            if data_path.has_label_mask:
                raise ConfigError("--sft runs with the local data loader: use --hdp-dataloader local")
            prefix = data_path
            sampler = data_path.sampler(step_tokens=step_tokens, context_length=context_length, seed=seed)
        else:
            prefix = os.path.abspath(dataset_prefix(data_path))  # actors may run elsewhere
            DocumentDataset(prefix, vocab_size=vocab_size)  # refuse bad files here, with a clear error
        self._position_type = sampler.position_type if sampler is not None else Position
        init_ray(address)
        self.rank, self.timeout_s, self.prefetch = rank, float(timeout_s), prefetch
        num_ranks = planner_config.num_ranks if planner_config is not None else None
        plan_fn = plan_fn or default_plan_fn(planner_config, cost)

        def named(suffix: str) -> dict:  # shared by every process that passes the same name
            return {"name": f"{name}-{suffix}", "namespace": NAMESPACE, "get_if_exists": True} if name else {}

        server_cls = ray.remote(DocumentServer)
        me = owner()
        self.servers = [
            server_cls.options(
                num_cpus=0,
                max_restarts=server_max_restarts,
                max_task_retries=server_max_restarts,
                **named(f"server-{k}"),
            ).remote(prefix, vocab_size, k, num_servers, owner=me, lease_s=LEASE_S)
            for k in range(num_servers)
        ]
        self.scheduler = (
            ray.remote(PlanScheduler)
            .options(num_cpus=0, max_restarts=0, max_concurrency=64, **named("scheduler"))
            .remote(
                self.servers,
                step_tokens=step_tokens,
                context_length=context_length,
                seed=seed,
                plan_fn=plan_fn,
                num_ranks=num_ranks,
                lookahead=lookahead,
                retain=retain,
                timeout_s=PLAN_TIMEOUT_S,  # its servers' start: part of the loader's start (_started)
                owner=me,
                lease_s=LEASE_S,
                sampler=sampler,
            )
        )
        self._closed = threading.Event()
        threading.Thread(target=self._keep_alive, name="bytescale-lease", daemon=True).start()
        self._fingerprint = self._started()
        mine = {"seed": seed, "step_tokens": step_tokens, "context_length": context_length}
        if any(self._fingerprint[k] != v for k, v in mine.items()):
            raise ConfigError(
                f"the named loader {name!r} already runs with {self._fingerprint}; this rank asked for {mine} - "
                "give every rank the same loader settings"
            )
        self.step, self.position = 0, sampler.start() if sampler is not None else Position()
        self._current: StepPlan | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ray-prefetch") if prefetch else None
        self._pending: dict[tuple[int, int], Future] = {}

    # ------------------------------------------------------------------ ray calls
    def _keep_alive(self) -> None:
        """Renew the actors' lease while this loader is open (a thread: training may not call them for minutes)."""
        while not self._closed.wait(LEASE_S / 4):
            for actor in [self.scheduler, *self.servers]:
                try:
                    actor.keepalive.remote()
                except Exception:  # noqa: BLE001 - a dead actor is reported where the loader calls it
                    pass

    def _started(self) -> dict:
        """The scheduler's fingerprint once it started and planned its first step: under the
        planning deadline, not the answer deadline (the actors start and a first plan on a machine
        also compiles the planner's kernels); a wait over SAY_AFTER_S says so (rank 0)."""
        ref = self.scheduler.ready.remote(PLAN_TIMEOUT_S)
        done, _ = ray.wait([ref], timeout=SAY_AFTER_S)
        if not done and self.rank in (None, 0):
            print(
                "bytescale: waiting for the Ray loader's actors to start and plan a first step (a first plan on a "
                f"machine also compiles the planner's kernels; up to {PLAN_TIMEOUT_S:.0f} s, BYTESCALE_PLAN_TIMEOUT_S)",
                flush=True,
            )
        return self._get(ref, "the dataloader scheduler actor (starting)", timeout_s=PLAN_TIMEOUT_S + self.timeout_s)

    def _get(self, refs, what: str, timeout_s: float | None = None):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            raise BytescaleError(
                f"{what} did not answer within {timeout_s:.0f}s; check that the Ray cluster is alive "
                "(`ray status`), or raise BYTESCALE_RAY_TIMEOUT_S if planning is legitimately this slow"
            ) from None
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, BytescaleError):
                raise cause from None
            if isinstance(cause, TimeoutError):
                raise BytescaleError(f"{what}: {cause}; the planner is too slow or stuck") from None
            raise BytescaleError(f"{what} failed: {exc}") from None
        except RayActorError as exc:
            raise BytescaleError(
                f"{what} died ({type(exc).__name__}); the data loader cannot continue - restart the job "
                f"from the last checkpoint (its loader state resumes the exact sample order). Cause: {exc}"
            ) from None

    def _step_plan(self, step: int) -> StepPlan:
        return self._get(self.scheduler.step_plan.remote(step, self.timeout_s), "the dataloader scheduler actor")

    def _fetch(self, step: int, rank: int) -> StepBatch:
        t0 = time.perf_counter()
        sp = self._step_plan(step)
        reads = list(dict.fromkeys(rank_token_ranges(sp, rank)))
        by_server = defaultdict(list)
        for r in reads:
            by_server[r[0] % len(self.servers)].append(r)
        order = sorted(by_server)
        results = self._get([self.servers[k].read.remote(by_server[k]) for k in order], f"document servers {order}")
        table = {r: arr for k, arrays in zip(order, results) for r, arr in zip(by_server[k], arrays)}
        mbs = deliver(sp, rank, lambda d, a, b: table[(d, a, b)])
        return StepBatch(
            step=step,
            rank=rank,
            plan=sp.plan,
            samples=sp.samples,
            micro_batches=mbs,
            bytes_read=int(sum(a.nbytes for a in table.values())),
            plan_s=sp.plan_s,
            delivery_s=time.perf_counter() - t0,
            next_position=sp.end,
        )

    # ------------------------------------------------------------------ steps
    def step_plan(self) -> StepPlan:
        if self._current is None:
            self._current = self._step_plan(self.step)
        return self._current

    def batch(self, rank: int | None = None) -> StepBatch:
        """``rank``'s micro-batches for the current step (prefetched when possible)."""
        rank = self._rank(rank)
        t0 = time.perf_counter()
        future = self._pending.pop((self.step, rank), None)
        batch = future.result() if future is not None else self._fetch(self.step, rank)
        batch.delivery_s = time.perf_counter() - t0  # what the rank waited for
        if self._current is None:
            self._current = StepPlan(
                batch.step, batch.samples, batch.plan, self.position, batch.next_position, batch.plan_s
            )
        if self._pool is not None and (self.step + 1, rank) not in self._pending:
            self._pending[(self.step + 1, rank)] = self._pool.submit(self._fetch, self.step + 1, rank)
        return batch

    def advance(self) -> None:
        sp = self.step_plan()
        self.step, self.position, self._current = sp.step + 1, sp.end, None
        for key in [k for k in self._pending if k[0] < self.step]:
            self._pending.pop(key).cancel()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return loader_state(self.step, self.position, self._fingerprint)

    def load_state_dict(self, state: dict) -> None:
        step, position = restore_state(state, self._fingerprint, self._position_type)
        self._drop_prefetch()
        self._get(self.scheduler.reset.remote(step, position.to_dict()), "the dataloader scheduler actor")
        self.step, self.position, self._current = step, position, None

    def _drop_prefetch(self) -> None:
        for future in self._pending.values():
            future.cancel()
        for future in self._pending.values():
            try:
                future.result(timeout=self.timeout_s)
            except BaseException:
                pass
        self._pending.clear()

    def close(self, kill_actors: bool = True) -> None:
        """Stop prefetching; kill the actors unless other ranks still use them (named loaders:
        pass ``kill_actors`` only from the last rank)."""
        self._closed.set()
        self._drop_prefetch()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if kill_actors:
            for actor in [self.scheduler, *self.servers]:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already gone
                    pass
