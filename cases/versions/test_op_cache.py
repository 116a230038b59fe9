"""Op builds keyed by content (``harness.buildenv``): releases whose op inputs are identical share one
build, and any change to what goes into a build (a source, a header it includes, a flag) gives a new
key. Pure and fast: temporary trees and a stand-in build, no compiler, no DeepSpeed build."""
from __future__ import annotations

import shutil

import pytest

from harness import buildenv


def _tree(root, header="int y;\n"):
    (root / "csrc/adam").mkdir(parents=True)
    (root / "csrc/includes").mkdir(parents=True)
    (root / "csrc/adam/op.cpp").write_text('#include "op.h"\n#include <vector>\n#include <torch/extension.h>\n')
    (root / "csrc/includes/op.h").write_text('#pragma once\n#include "deep.h"\n')
    (root / "csrc/includes/deep.h").write_text(header)
    (root / "csrc/includes/unused.h").write_text("int never_included;\n")
    return [str(root / "csrc/adam/op.cpp")], [str(root / "csrc/includes")]


def _inputs(src, inc, flags=("-O3",)):
    return {"name": "op", "files": buildenv.source_closure(src, inc), "cxx_args": list(flags)}


def test_closure_follows_includes_transitively_and_only_those(tmp_path):
    src, inc = _tree(tmp_path / "a")
    files = buildenv.source_closure(src, inc)
    assert sorted(files) == ["adam/op.cpp", "includes/deep.h", "includes/op.h"]  # system headers: not files here


def test_same_sources_in_two_places_share_a_key(tmp_path):
    a = _tree(tmp_path / "a")
    b = _tree(tmp_path / "venv-b/site-packages/deepspeed/ops")
    assert buildenv.op_key(_inputs(*a)) == buildenv.op_key(_inputs(*b))


@pytest.mark.parametrize("change", ["header", "source", "flag", "unused"])
def test_any_input_change_gives_a_new_key(tmp_path, change):
    src, inc = _tree(tmp_path / "a")
    before = buildenv.op_key(_inputs(src, inc))
    flags = ("-O3",)
    if change == "header":
        (tmp_path / "a/csrc/includes/deep.h").write_text("int y, z;\n")  # two includes deep
    elif change == "source":
        (tmp_path / "a/csrc/adam/op.cpp").write_text('#include "op.h"\n// changed\n')
    elif change == "flag":
        flags = ("-O2",)
    else:
        (tmp_path / "a/csrc/includes/unused.h").write_text("int changed;\n")
    after = buildenv.op_key(_inputs(src, inc, flags))
    if change == "unused":
        assert after == before  # a header nobody includes does not go into the build
    else:
        assert after != before
    assert buildenv.op_key(_inputs(src, inc, flags), ("dep",)) != after  # a dependency's key counts too


def test_a_missing_source_fails_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.cpp"):
        buildenv.source_closure([str(tmp_path / "gone.cpp")], [])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MUON_HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    return tmp_path / "cache"


def _fake_build(calls):
    def build():
        import os
        from pathlib import Path

        ext = Path(os.environ["TORCH_EXTENSIONS_DIR"])
        calls.append(str(ext))
        (ext / "op").mkdir(parents=True, exist_ok=True)
        (ext / "op" / "op.so").write_text(f"built in {ext}")
    return build


def test_a_second_release_with_the_same_key_links_instead_of_building(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.7")
    assert buildenv.ensure_op("op", "k1", _fake_build(calls)) == "built"
    assert calls == [str(buildenv.op_build_root("op", "k1"))]
    import os
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/elsewhere"  # restored after the build
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.8")
    assert buildenv.ensure_op("op", "k1", _fake_build(calls)) == "shared"
    assert len(calls) == 1
    linked = buildenv.extensions_dir() / "op" / "op.so"
    assert linked.read_text() == f"built in {buildenv.op_build_root('op', 'k1')}"
    assert buildenv.ensure_op("op", "k2", _fake_build(calls)) == "built"  # new sources: a new build
    assert len(calls) == 2 and "k2" in linked.read_text()


def test_a_build_that_leaves_no_library_fails(cache, monkeypatch):
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.7")
    with pytest.raises(RuntimeError, match="left no"):
        buildenv.ensure_op("op", "k1", lambda: None)


def test_an_existing_release_build_is_adopted_into_the_store(cache, monkeypatch):
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.7")
    mine = buildenv.extensions_dir() / "op"
    mine.mkdir(parents=True)
    (mine / "op.so").write_text("old build")
    (mine / "lock").write_text("")
    assert buildenv.ensure_op("op", "k1", lambda: pytest.fail("must not build")) == "present"
    stored = buildenv.op_build_root("op", "k1") / "op"
    assert (stored / "op.so").read_text() == "old build" and not (stored / "lock").exists()
    assert not mine.is_symlink()  # the release's own folder is left as it was (ranks may be loading it)
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.8")
    assert buildenv.ensure_op("op", "k1", lambda: pytest.fail("must not build")) == "shared"
    shutil.rmtree(mine)


def test_sharing_groups_releases_by_key():
    keys = {"0.19.6": {"cpu_adam": "a", "aio": "x"}, "0.19.7": {"cpu_adam": "b", "aio": "x"},
            "0.19.8": {"cpu_adam": "b"}}
    assert buildenv.sharing(keys) == {"aio": [["0.19.6", "0.19.7"]], "cpu_adam": [["0.19.6"], ["0.19.7", "0.19.8"]]}
