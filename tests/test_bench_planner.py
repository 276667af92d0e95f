"""benchmarks/bench_planner.py on a small cluster: every balance mode plans, the JSON keeps
each mode's figures and plan digest, the digest is the plan's (the same batch plans the same,
another batch differently), and --dataset picks the lengths."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_planner.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_planner", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(bench, tmp_path, *extra) -> dict:
    out = tmp_path / "planner.json"
    argv = ["--gpus", "512", "--tokens", "4M", "--repeat", "1", "--json", str(out), *extra]
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


def test_every_mode_plans_and_the_json_keeps_its_figures_and_digest(bench, tmp_path):
    result = run(bench, tmp_path, "--modes", "dp", "pp", "vpp", "ep", "--dataset", "github")
    assert result["workload"] == "data/workloads.py github" and result["batch"]["tokens"] == 4 * 2**20
    assert set(result["results"]) == {"dp", "pp", "vpp", "ep"}
    for mode, res in result["results"].items():
        assert re.fullmatch(r"[0-9a-f]{16}", res["plan_digest"]), mode
        assert len(res["plan_cpu_time_all_s"]) == 1 and res["plan_cpu_time_median_s"] > 0
        assert res["est_max_s"] >= res["est_mean_s"] > 0 and res["max_over_compute_bound"] >= 1.0
        assert (res["pp"], res["virtual_stages"], res["expert_parallel"]) == bench.MODES[mode][2:5]


def test_the_digest_is_the_plans(bench, tmp_path):
    """The same batch gives the same digest; another seed's batch another one."""
    digest = [
        run(bench, tmp_path, "--modes", "pp", "--seed", str(s))["results"]["pp"]["plan_digest"] for s in (0, 0, 1)
    ]
    assert digest[0] == digest[1] != digest[2]


def test_the_builtin_mix_is_byted_only(bench, tmp_path):
    with pytest.raises(SystemExit, match="--dataset github needs data/workloads.py"):
        run(bench, tmp_path, "--modes", "dp", "--workload", "builtin", "--dataset", "github")
