"""The status comparison of two results folders (``harness.report.statuses``) sees every kind of change."""
from __future__ import annotations

import json

from harness.report import statuses


def _folder(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    lines = []
    for case, column, status, bugs in rows:
        lines.append(json.dumps({"key": f"{case}-{column}", "case_name": case, "column": column, "status": status,
                                 "bug_ids": bugs, "mode": "-", "message": "", "reproduce": "", "case_json": "{}",
                                 "seconds": 0.0, "worst_ratio": 0.0, "strength": "full" if bugs else None}))
    (d / "results-gate.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_same_outcomes_compare_equal(tmp_path):
    rows = [("a", "stock", "xfailed", ["DSM-001"]), ("a", "patched", "passed", [])]
    assert statuses.main([str(_folder(tmp_path, "x", rows)), str(_folder(tmp_path, "y", rows))]) == 0


def test_status_bug_and_missing_changes_are_reported(tmp_path, capsys):
    x = _folder(tmp_path, "x", [("a", "stock", "xfailed", ["DSM-001"]), ("b", "stock", "passed", []),
                                ("c", "stock", "passed", [])])
    y = _folder(tmp_path, "y", [("a", "stock", "xfailed", ["DSM-002"]), ("b", "stock", "failed", [])])
    assert statuses.main([str(x), str(y)]) == 1
    out = capsys.readouterr().out
    assert "a [stock]: xfailed [DSM-001] (full) -> xfailed [DSM-002] (full)" in out
    assert "b [stock]: passed -> failed" in out
    assert "c [stock]: passed -> missing" in out


def test_an_empty_folder_is_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    assert statuses.main([str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2


def test_common_compares_only_what_both_hold(tmp_path, capsys):
    x = _folder(tmp_path, "x", [("a", "stock", "passed", []), ("b", "stock", "passed", [])])
    y = _folder(tmp_path, "y", [("a", "stock", "passed", [])])
    assert statuses.main([str(x), str(y)]) == 1
    assert statuses.main([str(x), str(y), "--common"]) == 0
    assert "1 only in the first" in capsys.readouterr().out
    z = _folder(tmp_path, "z", [("a", "stock", "failed", [])])
    assert statuses.main([str(x), str(z), "--common"]) == 1
