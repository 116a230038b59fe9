"""Reading a rank's traceback (``harness.judge.raised``): real tracebacks, raised here through files laid
out as DeepSpeed's are, so the reading is of Python's own format, not of a string written to match."""
from __future__ import annotations

import importlib.util
import traceback

import pytest

from harness.judge.raised import last_raise, refused_at_initialize

STAGE3 = '''
def build(cfg):
    if cfg.get("reduce_scatter", True):
        raise ValueError("Muon and reduce scatter cannot be used together")
    return object()
'''
INIT = '''
import importlib.util, os
_here = os.path.dirname(__file__)
_spec = importlib.util.spec_from_file_location("fake_stage3", os.path.join(_here, "runtime", "stage3.py"))
stage3 = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(stage3)

def initialize(cfg, hook=None):
    engine = stage3.build(cfg)
    if hook is not None:
        hook()
    return engine
'''


def _load(tmp_path):
    root = tmp_path / "site-packages" / "deepspeed"
    (root / "runtime").mkdir(parents=True)
    (root / "runtime" / "stage3.py").write_text(STAGE3)
    (root / "__init__.py").write_text(INIT)
    spec = importlib.util.spec_from_file_location("fake_deepspeed", root / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _traceback_of(fn) -> str:
    try:
        fn()
    except Exception:
        return traceback.format_exc()
    raise AssertionError("did not raise")


def test_a_refusal_raised_by_deepspeed_inside_initialize_is_read_with_its_words_and_frame(tmp_path):
    ds = _load(tmp_path)
    r = refused_at_initialize(_traceback_of(lambda: ds.initialize({})))
    assert r is not None
    assert (r.etype, r.message) == ("ValueError", "Muon and reduce scatter cannot be used together")
    assert r.innermost.where == "stage3.py:build" and r.innermost.in_deepspeed


def test_a_raise_in_the_harness_during_initialize_is_no_refusal(tmp_path):
    ds = _load(tmp_path)

    def harness_hook():
        raise AttributeError("capture adapter broke")

    tb = _traceback_of(lambda: ds.initialize({"reduce_scatter": False}, hook=harness_hook))
    assert last_raise(tb).etype == "AttributeError"
    assert refused_at_initialize(tb) is None


def test_a_raise_in_a_step_is_no_refusal(tmp_path):
    ds = _load(tmp_path)

    def step():
        ds.stage3.build({})  # DeepSpeed's frame, but not under initialize

    assert refused_at_initialize(_traceback_of(step)) is None


def test_a_chained_exception_is_read_from_its_last_block(tmp_path):
    ds = _load(tmp_path)

    def wrapped():
        try:
            ds.initialize({})
        except ValueError as exc:
            raise RuntimeError("rank 0 raised") from exc

    tb = _traceback_of(wrapped)
    r = last_raise(tb)
    assert (r.etype, r.message) == ("RuntimeError", "rank 0 raised")
    assert refused_at_initialize(tb) is None  # the last exception is the wrapper's, raised outside DeepSpeed


@pytest.mark.parametrize("text", ["", "rank 0 died with exit code -9", "Traceback (most recent call last):\n"])
def test_no_traceback_reads_as_nothing(text):
    assert last_raise(text) is None and refused_at_initialize(text) is None
