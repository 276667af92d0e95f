"""`bytescale COMMAND --help` answers at once: a command's module loads the library it drives
only when the command runs. Checked by what ``--help`` imports (numpy, numba, torch and
megatron-core cost seconds each to load), not by a wall-clock time."""

from __future__ import annotations

import json
import subprocess
import sys

from megatron_bytescale.cli import SUBCOMMANDS

HEAVY = ("numpy", "numba", "torch", "megatron.core", "matplotlib", "tqdm", "ray")

PROBE = """
import contextlib, io, json, sys
from megatron_bytescale import cli
seen = {}
for name in cli.SUBCOMMANDS:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([name, "--help"])
        except SystemExit as exc:
            code = exc.code
    seen[name] = {"code": code, "text": out.getvalue(), "heavy": [m for m in HEAVY if m in sys.modules]}
print(json.dumps(seen))
"""


def help_of_every_command() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n" + PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_every_help_loads_no_heavy_library():
    seen = help_of_every_command()
    assert set(seen) == set(SUBCOMMANDS)
    for name, got in seen.items():
        assert got["code"] == 0 and f"usage: bytescale {name}" in got["text"], name
        assert got["heavy"] == [], f"`bytescale {name} --help` imported {got['heavy']}"


def test_help_texts_name_what_the_library_accepts():
    """The lists a --help spells out without importing the library match the library's own."""
    from megatron_bytescale.commands import plan, profile, simulate
    from megatron_bytescale.planner.balance import BALANCE_MODES
    from megatron_bytescale.sim.simulate import NO_EXPERT_SLOTS
    from megatron_bytescale.sim.strategies import STRATEGIES
    from megatron_bytescale.tools import profiler

    assert simulate.STRATEGY_NAMES.split(", ") == list(STRATEGIES)
    assert simulate.NO_EXPERT_SLOTS == NO_EXPERT_SLOTS
    assert set(profile.DTYPE_NAMES) == set(profiler.DTYPES)
    assert profile.HOST_MEMORY_SHARE == profiler.HOST_MEMORY_SHARE
    assert set(plan.BALANCE_HELP.split(" | ")) == set(BALANCE_MODES)
