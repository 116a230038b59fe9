"""Source mutation (harness/selfcheck/source_mutation) without ranks: the scope resolves against the installed
DeepSpeed and is restricted by function, changed lines are found, case selection follows the
coverage map (signature lines included, cheapest first, unreached -> empty), the equivalents file
names real scoped mutants, and the verdict fails on a survivor that is not listed equivalent."""
from __future__ import annotations

import json
import re

import pytest

from harness.selfcheck.source_mutation import equivalents, report, scope, workspace
from harness.selfcheck.source_mutation.selection import CaseInfo, CoverageMap, changed_lines
from harness.selfcheck.source_mutation.session import mutant_key

DS = workspace.installed_deepspeed()


def test_every_scoped_function_resolves_and_selects_lines_inside_itself():
    resolved = scope.resolve(DS)
    assert len(resolved) == len(scope.SCOPE)
    for r in resolved:
        assert r.lines, f"{r.name}: no line selected"
        assert min(r.lines) >= r.first and max(r.lines) <= r.last, r.name
        assert r.first < r.body_first <= r.last + 1, r.name


def test_scope_is_by_function_not_by_file():
    """Code of a scoped file outside the scoped functions is out of scope (stage3's parameter fetching)."""
    resolved = scope.resolve(DS)
    text = (DS / "runtime/zero/stage3.py").read_text().splitlines()
    outside = [i for i, line in enumerate(text, 1) if scope.owner(resolved, "runtime/zero/stage3.py", i) is None]
    assert len(outside) > 0.8 * len(text)
    mu = next(r for r in resolved if r.entry.qualname == "muon_update")
    assert scope.owner(resolved, mu.entry.file, mu.first + 3) is mu


def test_muon_part_keeps_only_statements_mentioning_muon():
    resolved = scope.resolve(DS)
    r = next(r for r in resolved if r.entry.file == "runtime/zero/stage3.py" and r.entry.part == "muon"
             and r.entry.qualname.endswith(".__init__"))
    text = (DS / r.entry.file).read_text().splitlines()
    assert len(r.lines) < (r.last - r.first + 1) / 4
    assert any("muon" in text[i - 1].lower() for i in r.lines)


def test_a_missing_function_is_an_error_not_a_gap():
    with pytest.raises(scope.ScopeError, match="no function"):
        scope.resolve(DS, (scope.Scoped("runtime/zero/muon/original_muon.py", "no_such_function"),))


def test_changed_lines_of_a_one_token_mutation():
    a = "x = 1\ny = x + 2\nz = y\n"
    assert changed_lines(a, a.replace("x + 2", "x - 2")) == [2]
    assert changed_lines(a, a) == []


def _resolved_fake():
    e = scope.Scoped("f.py", "fn")
    return [scope.Resolved(e, first=10, last=20, body_first=12, lines=frozenset(range(10, 21)))]


def test_case_selection_cheapest_first_signature_and_unreached():
    cm = CoverageMap(lines={"f.py": {13: ["slow", "fast", "broken"], 15: ["fast"]}},
                     cases={"slow": CaseInfo("slow", 9.0, "passed", 2, "{}"),
                            "fast": CaseInfo("fast", 1.0, "xfailed", 2, "{}"),
                            "broken": CaseInfo("broken", 0.5, "failed", 2, "{}")})
    res = _resolved_fake()
    assert cm.cases_for(res, "f.py", [13]) == ["fast", "slow"]  # the failing baseline is not usable
    assert cm.cases_for(res, "f.py", [10]) == ["fast", "slow"]  # a default argument: the body's cases
    assert cm.cases_for(res, "f.py", [18]) == []  # not reached


def test_a_continuation_line_takes_the_cases_of_its_whole_statement_head():
    import ast
    import textwrap

    src = textwrap.dedent("""
        def fn(cache, total, cap):
            while (cache
                   and total > cap):
                cache.pop()
            return [x
                    for x in cache]
    """)
    fn = ast.parse(src).body[0]
    heads = scope._multiline_heads(fn)
    assert heads == ((3, 4), (6, 7))  # the while's condition, the return's expression; not the body
    e = scope.Scoped("f.py", "fn")
    res = [scope.Resolved(e, first=2, last=7, body_first=3, lines=frozenset(range(2, 8)), heads=heads)]
    cm = CoverageMap(lines={"f.py": {3: ["empty-cache"], 4: ["full-cache"], 5: ["full-cache"]}},
                     cases={"empty-cache": CaseInfo("empty-cache", 1.0, "passed", 2, "{}"),
                            "full-cache": CaseInfo("full-cache", 2.0, "passed", 2, "{}")})
    assert cm.cases_for(res, "f.py", [4]) == ["empty-cache", "full-cache"]  # line 4 short-circuited there
    assert cm.cases_for(res, "f.py", [5]) == ["full-cache"]  # a body line: its own cases only


def test_equivalents_name_scoped_mutants_with_a_reason():
    resolved = scope.resolve(DS)
    pat = re.compile(r"^(?P<file>[\w/.]+\.py):(?P<line>\d+):\d+ core/\w+#\d+$")
    for key, reason in equivalents.load("patched").items():
        m = pat.match(key)
        assert m, f"malformed key {key!r}"
        assert scope.owner(resolved, m["file"], int(m["line"])) is not None, f"{key} is out of scope"
        assert len(reason) > 10


def test_patched_only_equivalents_stay_judged_on_stock(tmp_path, monkeypatch):
    """A mutant listed for the patched column alone is not equivalent on stock (where a case may kill
    it), and a key listed in both files is refused."""
    stock, both = equivalents.load("stock"), equivalents.load("patched")
    only = set(both) - set(stock)
    assert only == set(equivalents.read(equivalents.PATCHED_FILE)) and only
    f = tmp_path / "p.txt"
    key = next(iter(stock))
    f.write_text(f"{key} | listed twice, which the loader refuses\n")
    monkeypatch.setattr(equivalents, "PATCHED_FILE", f)
    with pytest.raises(ValueError, match="already equivalent on both columns"):
        equivalents.load("patched")


def _dump_line(rel, op, occ, line, status, **rec):
    item = {"job_id": "x", "mutations": [{"module_path": rel, "operator_name": op, "occurrence": occ,
                                          "start_pos": [line, 4], "end_pos": [line, 5]}]}
    out = "noise\n" + report.RESULT_TAG + json.dumps(dict(status=status, **rec))
    return json.dumps([item, {"worker_outcome": "normal", "output": out, "test_outcome": "killed", "diff": "-a\n+b"}])


def test_score_excludes_unreached_equivalent_and_harness_errors_and_fails_on_a_survivor(tmp_path):
    res = _resolved_fake()
    lines = [_dump_line("f.py", "core/NumberReplacer", 0, 13, "killed", by="fast", seconds=3.0),
             _dump_line("f.py", "core/NumberReplacer", 1, 14, "survived", nearest="fast", seconds=5.0),
             _dump_line("f.py", "core/NumberReplacer", 2, 15, "survived", nearest="fast", seconds=5.0),
             _dump_line("f.py", "core/AddNot", 0, 18, "not-reached")]
    eq_key = mutant_key("f.py", "core/NumberReplacer", 2, (15, 4))
    ms = report.read_dump(lines, res, {eq_key: "a log message only"})
    assert [m.status for m in ms] == ["killed", "survived", "equivalent", "not-reached"]
    s = report.Summary(ms)
    assert s.score == 0.5
    ok, reasons = report.verdict(ms)
    assert not ok and "survived" in reasons[0]
    ok, _ = report.verdict([m for m in ms if m.status != "survived"])
    assert ok
    html = report.render_html(s)
    assert "f.py:14:4 core/NumberReplacer#1" in html and "nearest case" in html
    scoped = report.Summary(ms, scope={"f.py:fn": {"mutants": 4, "reached": 3}, "g.py:h": {"mutants": 2, "reached": 0}})
    assert "not reached: g.py:h (2 mutants)" in scoped.text() and "f.py:fn (" not in scoped.text()
    assert "g.py:h" in report.render_html(scoped)
    err = report.read_dump([_dump_line("f.py", "core/AddNot", 1, 13, "harness-error")], res, {})
    assert not report.verdict(err)[0] and report.Summary(err).score is None


def test_patched_column_spans_cover_every_replaced_function_decorators_included():
    from harness import fixes as patched_runtime
    from harness.selfcheck.source_mutation import patched

    spans = patched.spans(DS)
    keys = {t.key for f in patched_runtime.FIXES.values() for t in f.targets}
    # A target that is a module's binding of a function defined elsewhere (stage 0's import of
    # muon_update) has no lines of its own: the defining module's target spans them.
    bindings = {"deepspeed.runtime.zero.muon.muon_optimizer.muon_update"}
    assert {f"deepspeed.{s['file'][:-3].replace('/', '.')}.{s['qualname']}" for s in spans} == keys - bindings
    mu = next(s for s in spans if s["qualname"] == "muon_update")
    text = (DS / mu["file"]).read_text().splitlines()
    assert text[mu["first"] - 1].lstrip().startswith("@")  # the decorator line: the hash check reads it
    assert "muon-conv-kernels" in mu["fixes"]
    assert patched.replaced_by(spans, mu["file"], [mu["first"]]) is mu
    assert patched.replaced_by(spans, mu["file"], [mu["last"] + 1]) is None


def test_replaced_by_fix_is_counted_apart_never_scored_never_a_failure():
    res = _resolved_fake()
    lines = [_dump_line("f.py", "core/NumberReplacer", 0, 13, "killed", by="fast", seconds=3.0),
             _dump_line("f.py", "core/NumberReplacer", 1, 14, "replaced-by-fix", replaced="f.py:fn",
                        fixes=["some-fix"], detail="replaced")]
    ms = report.read_dump(lines, res, {})
    assert [m.status for m in ms] == ["killed", "replaced-by-fix"]
    s = report.Summary(ms)
    assert s.score == 1.0 and report.verdict(ms)[0]
    assert "replaced-by-fix 1" in s.text() and "REPLACED BY A FIX" in s.text()
    assert "Replaced by a fix" in report.render_html(s)


def test_no_global_norm_is_expected_only_where_the_config_turns_it_off():
    """compute_grad_norm false: DeepSpeed reports no norm by design, and the verdict checks exactly
    that; every other ZeRO case must still report one (a missing norm there fails as no data)."""
    from harness.catalog.matrix import overflow_cases
    from harness.judge.verdict import grad_norm_disabled, reports_global_norm

    cases = {c.name: c for c in overflow_cases()}
    off = cases["z2-none-fp16-ws2-nonorm-overflow"]
    assert grad_norm_disabled(off) and not reports_global_norm(off)
    on = cases["z2-none-fp16-ws2-overflow"]
    assert not grad_norm_disabled(on) and reports_global_norm(on)


def test_zygote_answers_a_request_in_a_forked_child_and_the_worker_forwards_to_it(tmp_path):
    """The warm judging process (harness.selfcheck.source_mutation.zygote): a request for an unmutated copy gets
    the worker's own "no-change" record back through the socket, from a forked child; with no
    server behind the socket ``ask`` says so (None) and the worker judges in its own process."""
    import os
    import subprocess
    import sys
    import time

    from harness.env import buildenv
    from harness.selfcheck.source_mutation import zygote

    site = tmp_path / "site"
    site.mkdir()
    (site / "deepspeed").symlink_to(DS)  # the installed package: no scoped file differs
    sock = tmp_path / "z.sock"
    env = dict(os.environ, PYTHONPATH=str(buildenv.PROJECT_ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "harness.selfcheck.source_mutation.zygote", "--socket", str(sock),
                             "--log", str(tmp_path / "z.log")], env=env)
    try:
        deadline = time.monotonic() + 300
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        CoverageMap({}, {}).dump(tmp_path / "map.json")
        req = {"site": str(site), "pristine": str(DS), "map": str(tmp_path / "map.json")}
        rec = zygote.ask(str(sock), req, timeout=120)
        assert rec == {"status": "no-change", "detail": "the copy equals the installed source"}, rec
    finally:
        proc.kill()
        proc.wait()
    assert zygote.ask(str(sock), req, timeout=5) is None


@pytest.mark.skipif(__import__("harness.selfcheck.source_mutation.cli", fromlist=["x"]).engine_executable() is None,
                    reason="Cosmic Ray not installed: bash scripts/run.sh makes .venv-mutation")
def test_session_records_listed_equivalents_without_a_run_unless_asked(tmp_path):
    """A listed equivalent costs a survivor's whole run for a verdict already argued in writing, so the
    session gives it its result at build time; --judge-equivalents (an audit of the list) leaves it pending,
    and a premarked one whose line leaves the list reads as pending, never as equivalent."""
    import os
    import subprocess

    from harness.env import buildenv
    from harness.selfcheck.source_mutation.cli import engine_executable

    resolved = scope.resolve(DS)
    fn = next(r for r in resolved if r.entry.qualname == "ns_compute_dtype")
    cmap = CoverageMap(lines={fn.entry.file: {i: ["c"] for i in range(fn.first, fn.last + 1)}},
                       cases={"c": CaseInfo("c", 1.0, "passed", 1, "{}")})
    cmap.dump(tmp_path / "map.json")
    listed = {k for k in equivalents.load() if k.startswith(f"{fn.entry.file}:")
              and fn.first <= int(k.split(":")[1]) <= fn.last}
    assert listed, "ns_compute_dtype has listed equivalents (equivalents.txt)"
    engine = engine_executable()
    env = dict(os.environ, PYTHONPATH=str(buildenv.PROJECT_ROOT))

    def build(name, *extra):
        r = subprocess.run([str(engine.parent / "python"), "-m",
                            "harness.selfcheck.source_mutation.session", "--session",
                            str(tmp_path / name), "--map", str(tmp_path / "map.json"), "--only", "ns_compute_dtype",
                            *extra], cwd=DS, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        dump = subprocess.run([str(engine), "dump", str(tmp_path / name)], cwd=DS, env=env, capture_output=True,
                              text=True, timeout=300)
        return json.loads(r.stdout), dump.stdout.splitlines()

    info, lines = build("a.sqlite")
    assert info["equivalent_not_judged"] == len(listed) and info["not_reached"] == 0
    ms = report.read_dump(lines, resolved, equivalents.load())
    assert {m.key for m in ms if m.status == "equivalent"} == listed
    assert all(m.status == "pending" for m in ms if m.key not in listed) and len(ms) > len(listed)
    assert all(m.reason for m in ms if m.status == "equivalent")
    gone = report.read_dump(lines, resolved, {})  # the list no longer names them: judge them again
    assert all(m.status == "pending" for m in gone)
    info, lines = build("b.sqlite", "--judge-equivalents")
    assert info["equivalent_not_judged"] == 0
    pending = report.read_dump(lines, resolved, equivalents.load())
    assert all(m.status == "pending" for m in pending)
    # a ledger's judged results are taken over; a listed equivalent stays equivalent whatever it says
    from harness.selfcheck.source_mutation import ledger

    first, second = sorted(m.key for m in pending if m.key not in listed)[:2]
    book = tmp_path / "stock-x.jsonl"
    assert ledger.append(book, {first: {"status": "killed", "by": "c", "seconds": 2.0},
                                second: {"status": "survived", "nearest": "c"},
                                next(iter(listed)): {"status": "survived", "nearest": "c"}}, "abc") == 3
    info, lines = build("c.sqlite", "--ledger", str(book))
    assert info["from_ledger"] == 2 and info["equivalent_not_judged"] == len(listed)
    got = {m.key: m for m in report.read_dump(lines, resolved, equivalents.load())}
    assert got[first].status == "killed" and got[first].record["by"] == "c"
    assert got[first].record["from_ledger"] == "abc" and got[second].status == "survived"
    assert {k for k, m in got.items() if m.status == "pending"} == set(got) - listed - {first, second}
    assert "carried from the ledger: 2" in report.Summary(list(got.values())).text()


def test_ledger_keeps_judged_results_newest_last_and_never_copies_itself(tmp_path):
    from harness.selfcheck.source_mutation import ledger

    book = tmp_path / "stock-d.jsonl"
    recs = {"a": {"status": "killed", "by": "c1", "seconds": 1.5, "tried": [1]}, "b": {"status": "not-reached"},
            "c": {"status": "survived", "nearest": "c2"}, "d": {"status": "killed", "by": "c1", "from_ledger": "x"}}
    assert ledger.append(book, recs, "h1") == 2
    assert ledger.append(book, recs, "h2") == 0  # the same verdicts are not written twice
    assert ledger.append(book, {"c": {"status": "killed", "by": "c3"}}, "h3") == 1
    got = ledger.load(book)
    assert set(got) == {"a", "c"} and got["c"]["status"] == "killed" and got["c"]["commit"] == "h3"
    assert "tried" not in got["a"] and ledger.as_record(got["a"])["from_ledger"] == "h1"
    book.write_text(book.read_text() + "not json\n")
    with pytest.raises(ValueError, match="stock-d.jsonl:4"):
        ledger.load(book)
