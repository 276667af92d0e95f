import numpy as np

from megatron_bytescale.sim.plot import plot_timelines, sampled_rows
from megatron_bytescale.sim.timeline import Timeline


def test_rows_are_sampled_evenly_when_there_are_too_many():
    rows = sampled_rows(1024, 48)
    assert len(rows) == 48 and rows[0] == 0 and rows[-1] == 1023
    assert np.all(np.diff(rows) > 0)
    assert list(sampled_rows(5, 48)) == [0, 1, 2, 3, 4]


def test_gantt_chart_of_many_ranks(tmp_path):
    ops = [np.array([[0.0, 1.0, 0, 0.8, 0.2, 0.0], [1.0, 3.0 + r / 100, 1, 1.5, 0.3, 0.1]]) for r in range(100)]
    t = Timeline(step_time=4.0, num_ranks=100, stages=1, ops=ops, barriers=[1.0])
    path = plot_timelines({"a": t, "b": t}, tmp_path / "g.png", lower_bound=2.5, max_rows=10)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_legend_and_title_name_only_what_is_drawn(tmp_path, monkeypatch):
    """A measured step (the demo's): forward, backward and exposed communication only, no
    barriers and no lower bound, so neither the offload colours nor the dotted lines are named."""
    from matplotlib.figure import Figure

    seen = {}
    legend, suptitle = Figure.legend, Figure.suptitle

    def record_legend(self, **kw):
        seen["labels"] = [h.get_label() for h in kw["handles"]]
        return legend(self, **kw)

    monkeypatch.setattr(Figure, "legend", record_legend)
    monkeypatch.setattr(Figure, "suptitle", lambda self, text, **kw: seen.update(title=text) or suptitle(self, text))
    ops = [np.array([[0.0, 1.0, 0, 0.8, 0.2, 0.0], [1.0, 3.0, 1, 2.0, 0.0, 0.0]]) for _ in range(4)]
    plot_timelines({"measured": Timeline(3.0, 4, 1, ops)}, tmp_path / "m.png", title="demo")
    assert seen["labels"] == ["forward", "backward", "exposed comm", "idle"]
    assert seen["title"] == "demo"
    ops = [np.array([[0.0, 1.0, 0, 0.5, 0.2, 0.3]]) for _ in range(2)]
    plot_timelines({"sim": Timeline(1.0, 2, 1, ops, barriers=[0.5])}, tmp_path / "s.png", lower_bound=0.8)
    assert "exposed offload" in seen["labels"] and "backward" not in seen["labels"]
    assert seen["title"] == "dashed: lower bound; dotted: barriers"
