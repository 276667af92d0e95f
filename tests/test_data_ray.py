"""The Ray remote loader on a small local Ray (2 CPUs, no dashboard, one session for the
module): same samples as the local loader, server faults repaired by Ray with nothing lost,
exact resume, and clear errors instead of hangs."""

import json
import os
import time
from pathlib import Path

import pytest
import ray

from megatron_bytescale.data.local_loader import LocalDataLoader
from megatron_bytescale.data.planning import SamplesDigest
from megatron_bytescale.data.ray_loader import RayDataLoader, check_reachable, init_ray
from megatron_bytescale.errors import BytescaleError, ConfigError
from megatron_bytescale.planner.planner import PlannerConfig

from data_support import build_corpus

RANKS, CAPACITY = 4, 2048
CONFIG = PlannerConfig(num_ranks=RANKS, capacity=CAPACITY)  # the shipped default planner
SETTINGS = dict(step_tokens=3 * RANKS * CAPACITY, context_length=RANKS * CAPACITY, seed=5)
STEPS = 8


@pytest.fixture(scope="module")
def ray_session():
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus):
    """Per-step digests of the local loader, the ground truth for every Ray run."""
    loader = LocalDataLoader(corpus, CONFIG, **SETTINGS)
    return [step_digest(loader) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def loader(ray_session, corpus):
    ld = RayDataLoader(corpus, CONFIG, num_servers=2, lookahead=3, timeout_s=60, **SETTINGS)
    start = ld.state_dict()
    yield ld, start
    ld.close()


def step_digest(loader):
    d = SamplesDigest()
    for rank in range(RANKS):
        d.add(loader.batch(rank))
    loader.advance()
    return d.hexdigest()


def test_ray_and_local_modes_deliver_identical_samples(loader, reference):
    ld, start = loader
    ld.load_state_dict(start)
    assert [step_digest(ld) for _ in range(STEPS)] == reference
    assert len(set(reference)) == STEPS


def test_a_killed_server_is_restarted_and_nothing_is_lost(loader, reference):
    ld, start = loader
    ld.load_state_dict(start)
    pids = ray.get([s.pid.remote() for s in ld.servers], timeout=60)
    got = [step_digest(ld) for _ in range(2)]
    ld.batch(0)  # its prefetch of the next step is now in flight
    ray.kill(ld.servers[0], no_restart=False)  # dies mid-run; Ray restarts it and retries its reads
    got.append(step_digest(ld))
    ray.kill(ld.servers[1], no_restart=False)
    got += [step_digest(ld) for _ in range(STEPS - 3)]
    assert got == reference
    # ray.kill is asynchronous: allow the death to be registered, then both must be new processes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new_pids = ray.get([s.pid.remote() for s in ld.servers], timeout=60)
        if all(a != b for a, b in zip(pids, new_pids)):
            break
        time.sleep(0.5)
    assert all(a != b for a, b in zip(pids, new_pids)), (pids, new_pids)  # both really died and came back


def test_resume_from_saved_state_continues_identically(loader, reference):
    ld, start = loader
    ld.load_state_dict(start)
    head = [step_digest(ld) for _ in range(3)]
    state = json.loads(json.dumps(ld.state_dict()))
    [step_digest(ld) for _ in range(2)]  # train on, then "crash" back to the checkpoint
    ld.load_state_dict(state)
    assert head + [step_digest(ld) for _ in range(STEPS - 3)] == reference


def test_bad_dataset_path_is_a_config_error_before_any_actor_starts(ray_session, tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        RayDataLoader(tmp_path / "absent", CONFIG, **SETTINGS)


def test_dead_scheduler_is_a_clear_error_and_a_new_loader_resumes_exactly(ray_session, corpus, reference):
    ld = RayDataLoader(corpus, CONFIG, num_servers=1, timeout_s=30, **SETTINGS)
    head = [step_digest(ld) for _ in range(2)]
    state = ld.state_dict()
    ray.kill(ld.scheduler)
    t0 = time.monotonic()
    with pytest.raises(BytescaleError, match="scheduler actor died.*restart the job from the last checkpoint"):
        for _ in range(3):  # a prefetched step may still be served; the next plan cannot be
            step_digest(ld)
    assert time.monotonic() - t0 < 30  # an error, not a hang
    ld.close()
    again = RayDataLoader(corpus, CONFIG, num_servers=1, timeout_s=60, **SETTINGS)
    again.load_state_dict(state)
    assert head + [step_digest(again) for _ in range(STEPS - 2)] == reference
    again.close()


def test_bench_digest_is_equal_across_modes(ray_session, corpus, tmp_path):
    from megatron_bytescale import cli

    results = {}
    for mode in ("local", "ray"):
        out = tmp_path / f"{mode}.json"
        argv = [
            "dataloader-bench",
            "--mode",
            mode,
            "--ranks",
            "4",
            "--steps",
            "3",
            "--capacity",
            "1024",
            "--servers",
            "1",
            "--seed",
            "9",
            "--data",
            corpus,
            "--json",
            str(out),
        ]
        assert cli.main(argv) == 0
        results[mode] = json.loads(out.read_text())
    assert results["local"]["samples_digest"] == results["ray"]["samples_digest"]
    assert results["local"]["bytes_read_all_ranks"] == results["ray"]["bytes_read_all_ranks"]


def _named_rank(rank, world_size, corpus, address, steps):
    init_ray(address=address)
    loader = RayDataLoader(corpus, CONFIG, rank=rank, name="shared-loader", num_servers=1, timeout_s=120, **SETTINGS)
    digests = []
    for _ in range(steps):
        d = SamplesDigest()
        d.add(loader.next_step())
        digests.append(d.hexdigest())
    loader.close(kill_actors=False)  # the launcher owns the actors
    ray.shutdown()
    return digests


def test_the_first_plan_is_waited_for_under_the_planning_deadline_not_the_answer_deadline(ray_session, corpus):
    # a first plan that compiles the planner's kernels (here: sleeps 4 s) outlasts a 2 s answer
    # deadline; the loader waits for it under the planning deadline and then trains as always
    from ray import cloudpickle

    from megatron_bytescale.data.planning import default_plan_fn

    import data_support

    cloudpickle.register_pickle_by_value(data_support)  # the actor's interpreter has no tests/ on its path
    slow = data_support.SlowOnCall(default_plan_fn(CONFIG), call=0, seconds=4.0)
    ld = RayDataLoader(corpus, CONFIG, num_servers=1, lookahead=2, timeout_s=2, plan_fn=slow, **SETTINGS)
    try:
        t0 = time.monotonic()
        for rank in range(RANKS):
            ld.batch(rank)
        assert time.monotonic() - t0 < 2  # planned while the loader waited for it
    finally:
        ld.close()


def test_an_actor_ends_itself_when_its_owner_is_gone_or_no_loader_calls(ray_session, corpus):
    # what Ray does for them only while its GCS lives (the battery kills the GCS itself:
    # scripts/reliability_battery.py, case ray-gcs-killed)
    import socket
    import subprocess

    from megatron_bytescale.data.ray_loader import DocumentServer
    from megatron_bytescale.process_lifetime import _alive

    from lifetime_support import wait_for

    owner = subprocess.Popen(["sleep", "600"])
    server = ray.remote(DocumentServer).options(num_cpus=0)
    watching = server.remote(corpus, None, 0, 1, owner=(socket.gethostname(), owner.pid), lease_s=600)
    leased = server.remote(corpus, None, 0, 1, owner=("another-node", 1), lease_s=3)
    pids = ray.get([watching.pid.remote(), leased.pid.remote()], timeout=300)  # actors start slowly on a loaded machine
    try:
        owner.kill()
        owner.wait()
        wait_for(lambda: not _alive(pids[0]), 10, "the actor whose owner died to end")
        wait_for(lambda: not _alive(pids[1]), 20, "the actor nobody called for 3 s to end")
    finally:
        for actor in (watching, leased):
            ray.kill(actor)


def test_ranks_in_separate_processes_share_one_named_loader(ray_session, corpus):
    from megatron_bytescale.local_world import run_local_world

    owner = RayDataLoader(corpus, CONFIG, name="shared-loader", num_servers=1, timeout_s=60, **SETTINGS)
    address = ray.get_runtime_context().gcs_address
    check_reachable(address)  # a real Ray head passes the probe that refuses other servers
    try:
        results = run_local_world(_named_rank, RANKS, corpus, address, 3, timeout_s=180)
        reference = LocalDataLoader(corpus, CONFIG, **SETTINGS)
        for step in range(3):
            for rank in range(RANKS):
                d = SamplesDigest()
                d.add(reference.batch(rank))
                assert results[rank][step] == d.hexdigest()
            reference.advance()
    finally:
        owner.close()


def test_a_head_that_refuses_our_token_is_named_as_such_in_seconds(tmp_path):
    """A real Ray head started with token authentication: a process with another token (or none)
    is told the head refuses its token, not that the port may be wrong; the right token passes."""
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "0123456789abcdef" * 2
    temp = tempfile.mkdtemp(prefix="/tmp/rt")  # Ray's socket paths must stay short
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            "--port",
            str(port),
            "--num-cpus",
            "1",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--temp-dir",
            temp,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    probe = (
        "import time; t = time.monotonic()\n"
        "from megatron_bytescale.data.ray_loader import init_ray\n"
        "from megatron_bytescale.errors import ConfigError\n"
        "try:\n    init_ray(ADDRESS)\nexcept ConfigError as exc:\n    print('refused:', exc)\n"
        "print(f'{time.monotonic() - t:.1f} s')\n"
    ).replace("ADDRESS", repr(f"127.0.0.1:{port}"))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        time.sleep(3)  # the GCS listens before it serves
        for name, variables in (
            ("wrong token", dict(RAY_AUTH_TOKEN="f" * 32, RAY_AUTH_MODE="token")),
            ("no token", {}),
        ):
            clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
            proc = subprocess.run(
                [sys.executable, "-c", probe], env=dict(clean, **variables), capture_output=True, text=True, timeout=120
            )
            print(name, proc.stdout.strip().splitlines()[-1])
            assert proc.stdout.startswith(
                f"refused: --address 127.0.0.1:{port}: the Ray head refuses this process's authentication token"
            ), (name, proc.stdout, proc.stderr[-2000:])
            assert "InvalidAuthToken" not in proc.stderr and "GCS port" not in proc.stdout
        right = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from megatron_bytescale.data.ray_loader import check_token; "
                f"check_token('127.0.0.1:{port}'); print('passed')",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert right.stdout.strip() == "passed", right.stderr[-2000:]
    finally:
        os.killpg(head.pid, 15)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)


def test_a_split_of_a_blend_is_served_as_the_local_loader_reads_it(ray_session, corpus):
    """What training with --data-path W1 P1 W2 P2 and --split hands the Ray loader: the
    stream's documents (documents.StreamDocuments, pickled to the servers), one id space over
    the parts; the same samples as the local loader on the same stream."""
    from megatron_bytescale.data.documents import Part, StreamSpec, open_stream

    spec = StreamSpec("train", (Part(corpus, 0.3, (0.0, 0.9)), Part(corpus, 0.7, (0.0, 0.9))))
    kwargs = dict(context_length=SETTINGS["context_length"], seed=SETTINGS["seed"])
    local = LocalDataLoader(open_stream(spec, **kwargs), CONFIG, **SETTINGS)
    expected = [step_digest(local) for _ in range(3)]
    served = RayDataLoader(open_stream(spec, **kwargs), CONFIG, num_servers=2, lookahead=2, timeout_s=60, **SETTINGS)
    try:
        assert [step_digest(served) for _ in range(3)] == expected
    finally:
        served.close()
