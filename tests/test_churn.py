"""`thinwire bench churn`'s accounting (issue 34, item 6): goodput and time to target from the workers' step
logs, on hand-made logs; the kill schedule; bad arguments (diloco's settings too) refused before anything starts."""
from __future__ import annotations

import json

import pytest

from thinwire.bench import churn


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_goodput_counts_the_steps_a_boundary_kept(tmp_path):
    # worker 0: 4 steps of 1 s, a boundary every 2 steps (local SGD's average), all kept
    _write(tmp_path / "1.jsonl", [{"m": 0, "s": s, "a": s - 1.0, "b": float(s), "c": s - s % 2, "d": 0}
                                  for s in range(1, 5)])
    # worker 1: steps 1-2 kept at the boundary of step 2; step 3 done; a loss during step 4 throws steps 3-4 away
    _write(tmp_path / "2.jsonl", [{"m": 1, "s": 1, "a": 0.0, "b": 1.0, "c": 0, "d": 0},
                                  {"m": 1, "s": 2, "a": 1.0, "b": 2.0, "c": 2, "d": 0},
                                  {"m": 1, "s": 3, "a": 2.0, "b": 3.0, "c": 2, "d": 0},
                                  {"m": 1, "s": 4, "a": 3.0, "b": 4.0, "c": 2, "d": 1},
                                  {"m": 1, "s": 2, "e": 0.96, "b": 2.5}])
    # worker 2 was killed after two steps, before any boundary: nothing of it counts
    _write(tmp_path / "3.jsonl", [{"m": 2, "s": 1, "a": 0.0, "b": 1.0, "c": 0, "d": 0},
                                  {"m": 2, "s": 2, "a": 1.0, "b": 1.5, "c": 0, "d": 0}])
    got = churn.analyse(str(tmp_path), 3, "accuracy", 0.95, lambda v, t: v >= t)
    assert got["wall_s"] == 4.0
    assert got["goodput"] == pytest.approx((4.0 + 2.0) / (3 * 4.0))
    assert got["steps_kept"] == 6
    assert got["time_to_target_s"] == 2.5 and got["steps_to_target"] == 2


def test_the_timelines_show_kept_and_lost_steps(tmp_path):
    logs = tmp_path / "logs" / "localsgd"
    logs.mkdir(parents=True)
    _write(logs / "1.jsonl", [{"m": 0, "s": s, "a": s - 1.0, "b": float(s), "c": s - s % 2, "d": 0}
                              for s in range(1, 5)])
    _write(logs / "2.jsonl", [{"m": 1, "s": 1, "a": 0.0, "b": 1.0, "c": 0, "d": 0},
                              {"m": 1, "s": 2, "a": 1.0, "b": 2.0, "c": 0, "d": 1}])
    assert churn.kept(churn.read_logs(str(logs))[0][1]) == [False, False]
    row = {"contestant": "localsgd", **churn.analyse(str(logs), 2, "accuracy", 0.95, lambda v, t: v >= t),
           "kills": [{"t": 1.5, "position": 1, "pid": 2}]}
    result = {"workload": "digits-mlp", "workers": 2, "network": "world", "kill_every_s": 30.0,
              "rows": [row, {"contestant": "ddp", "error": "failed"}]}
    path = churn.plot(result, str(tmp_path))
    assert path == str(tmp_path / "churn.png") and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_every_contestant_suffers_the_same_kills():
    assert churn.schedule(0, 30.0, 5) == churn.schedule(0, 30.0, 5)
    assert [t for t, _ in churn.schedule(0, 30.0, 3)] == [30.0, 60.0, 90.0]
    assert churn.schedule(0, 30.0, 5) != churn.schedule(1, 30.0, 5)


@pytest.mark.parametrize("argv,message", [
    (["--contestants", "bsp,nosuch"], "unknown contestant 'nosuch'"),
    (["--kill-every", "0"], "--kill-every must be"),
    (["--min-workers", "4"], "--min-workers must be"),
    (["--limit", "0"], "--limit must be"),
    (["--contestants", "localsgd", "--compressor", "fp4"], "which --contestants leaves out"),
    (["--contestants", "diloco", "--compressor", "nosuch"], "unknown compressor 'nosuch'"),
    (["--contestants", "diloco", "--param", "overlap=-1"], "diloco overlap must be an integer >= 0"),
    (["--contestants", "diloco", "--nosuch", "1"], "unknown parameter 'nosuch' for algorithm 'diloco'"),
])
def test_bad_arguments_are_one_line_before_anything_starts(capsys, argv, message):
    from thinwire.cli import main
    assert main(["bench", "churn", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_diloco_runs_the_planners_settings_where_none_are_given(monkeypatch):
    """With none of --period, --compressor, --memory, --param, thinwire's diloco runs what the planner picks for the
    network from the step measured here (`compare`'s planning of a cell that names only `diloco`); localsgd and
    torchft's DiLoCo keep H = 16."""
    from thinwire.cli import build_parser, parse_extra
    from thinwire.compare.forecast import tune_cell
    from thinwire.compare.presets import Cell
    monkeypatch.setattr(churn, "measure_step", lambda workload, workers, local: {"compute_s": 0.12})
    args, extra = build_parser().parse_known_args(["bench", "churn", "--network", "home", "--contestants",
                                                   "diloco,localsgd"])
    args.extra = parse_extra(extra)
    assert churn.check(args) == ["diloco", "localsgd"] and not churn.given(args)
    args.planned = churn.plan_diloco(args)
    want = tune_cell(Cell("diloco", "diloco"), "home", "stdlib-lm", 4, 0.12)[0]
    d, loc = churn._config(args, "diloco"), churn._config(args, "localsgd")
    assert (d.params, d.compressor, d.memory) == (want.params, want.compressor, want.memory)
    assert d.params["period"] != churn.PERIOD and d.compressor and d.params.get("overlap")   # a thin link's plan
    assert (loc.params, loc.compressor) == ({"period": churn.PERIOD}, None)


def test_diloco_takes_the_settings_given_and_the_others_keep_theirs():
    """`--compressor`, `--memory` and `--param` reach thinwire's diloco job (the planner's settings for a thin link)
    and nothing else: localsgd keeps H = --period and no compressor."""
    from thinwire.cli import build_parser, parse_extra
    args, extra = build_parser().parse_known_args(["bench", "churn", "--network", "home", "--contestants",
                                                   "diloco,localsgd", "--period", "40", "--compressor", "fp4",
                                                   "--memory", "residual", "--param", "overlap=17", "--alpha", "0.5"])
    args.extra = parse_extra(extra)
    assert churn.check(args) == ["diloco", "localsgd"]
    d, loc = churn._config(args, "diloco"), churn._config(args, "localsgd")
    assert (d.compressor, d.memory, d.params) == ("fp4", "residual", {"period": 40, "overlap": "17", "alpha": "0.5"})
    assert (loc.compressor, loc.memory, loc.params) == (None, None, {"period": 40})
    assert d.elastic == loc.elastic == "2:4" and d.network == "home"

