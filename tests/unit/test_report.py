"""`serve-rft report` renders a run's reward and version timeline."""

import json

from typer.testing import CliRunner

from serve_rft.cli import cli
from serve_rft.demo.report import load_runs, plateau, table_rows, version_series

DEMO = {"reward_curve": [{"t_s": 0, "mean_reward": 0.3, "n": 10}, {"t_s": 30, "mean_reward": 0.6, "n": 30},
                         {"t_s": 60, "mean_reward": 0.9, "n": 10}],
        "reward_by_version": {"0": {"mean": 0.3, "n": 10}, "2": {"mean": 0.5, "n": 20}, "10": {"mean": 0.9, "n": 20}},
        "replica_timeline": {"a": [{"t_s": 0.1, "state": "RUNNING", "policy_version": 0},
                                   {"t_s": 40.0, "state": "RUNNING", "policy_version": 10}]}}


def test_report_renders_a_png_and_a_table(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(DEMO))
    res = CliRunner().invoke(cli, ["report", str(path), "--window", "2"])
    assert res.exit_code == 0, res.output
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = load_runs(path)
    assert version_series(runs["run"]) == ([0, 2, 10], [0.3, 0.5, 0.9], [10, 20, 20])
    assert table_rows(runs["run"])[0] == ("0-30 s", "0.300", "10")
    assert plateau(runs["run"]) == (0.6 * 30 + 0.9 * 10) / 40


def test_report_of_a_file_that_is_no_report_exits_2(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{}")
    assert CliRunner().invoke(cli, ["report", str(path)]).exit_code == 2
