"""RunCSVLogger: a resumed run appends to metrics.csv, also when its metric columns differ."""

import csv

from k3lit.train.csv_log import RunCSVLogger


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_append_widens_the_header_and_keeps_earlier_rows(tmp_path):
    first = RunCSVLogger(tmp_path)
    first.log_metrics({"a": 1.0, "z": 2.0}, step=0)
    first.save()
    resumed = RunCSVLogger(tmp_path, append=True)
    resumed.log_metrics({"a": 3.0, "b": 4.0}, step=1)  # a new column (b), one missing (z)
    resumed.save()
    resumed.log_metrics({"a": 5.0}, step=2)
    resumed.save()
    assert _rows(tmp_path / "metrics.csv") == [
        {"a": "1.0", "b": "", "step": "0", "z": "2.0"},
        {"a": "3.0", "b": "4.0", "step": "1", "z": ""},
        {"a": "5.0", "b": "", "step": "2", "z": ""},
    ]


def test_fresh_run_moves_an_earlier_file_aside(tmp_path):
    for value in (1.0, 2.0, 3.0):
        logger = RunCSVLogger(tmp_path)
        logger.log_metrics({"a": value}, step=0)
        logger.save()
    assert [r["a"] for r in _rows(tmp_path / "metrics.csv")] == ["3.0"]
    assert [r["a"] for r in _rows(tmp_path / "metrics.1.csv")] == ["1.0"]
    assert [r["a"] for r in _rows(tmp_path / "metrics.2.csv")] == ["2.0"]
