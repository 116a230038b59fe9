"""Op builds keyed by content (``harness.env.buildenv``): releases whose op inputs are identical share one
build, and any change to what goes into a build (a source, a header it includes, a flag) gives a new
key. Pure and fast: temporary trees and a stand-in build, no compiler, no DeepSpeed build."""
from __future__ import annotations

import ctypes
import json
import shutil
import sys
from pathlib import Path

import pytest

from harness.env import buildenv


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


def test_the_release_folder_is_a_copy_so_a_jit_rebuild_there_leaves_the_store_build_intact(cache, monkeypatch):
    """A JIT ``load`` from another checkout's venv relinks ``<release>/op/op.so`` in place (CI saw ranks fail
    with ``invalid ELF header`` meanwhile): it must not reach the store build ranks import."""
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.8")
    assert buildenv.ensure_op("op", "k1", _fake_build([])) == "built"
    mine = buildenv.extensions_dir() / "op"
    assert mine.is_dir() and not mine.is_symlink()
    (mine / "op.so").write_text("half-written by a JIT rebuild")
    store = buildenv.op_build_root("op", "k1") / "op"
    assert (store / "op.so").read_text() == f"built in {buildenv.op_build_root('op', 'k1')}"
    assert buildenv.read_built_ops() == {"op": {"key": "k1", "folder": str(store)}}
    # the warm-up again, same key: nothing rebuilt, and the release copy is left to whoever rebuilt it
    assert buildenv.ensure_op("op", "k1", lambda: pytest.fail("must not build")) == "present"
    assert (mine / "op.so").read_text() == "half-written by a JIT rebuild"


def test_a_release_folder_left_as_a_link_by_an_older_cache_becomes_a_copy(cache, monkeypatch):
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.7")
    assert buildenv.ensure_op("op", "k1", _fake_build([])) == "built"
    monkeypatch.setattr(buildenv, "deepspeed_version", lambda: "0.19.8")
    mine = buildenv.extensions_dir() / "op"
    mine.parent.mkdir(parents=True)
    mine.symlink_to(buildenv.op_build_root("op", "k1") / "op", target_is_directory=True)
    assert buildenv.ensure_op("op", "k1", lambda: pytest.fail("must not build")) == "shared"
    assert not mine.is_symlink() and (mine / "op.so").read_text().startswith("built in")


def test_ranks_import_the_recorded_store_build_not_the_release_folder(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp
    from deepspeed.ops.op_builder.builder import OpBuilder

    from harness.rank import runtime_state

    ext, store = tmp_path / "ext", tmp_path / "store" / "fused_adam"
    for folder, text in ((ext / "fused_adam", "rewritten by a JIT load"), (store, "the warm-up's build")):
        folder.mkdir(parents=True)
        (folder / "fused_adam.so").write_text(text)
    (ext / "built-ops.json").write_text(json.dumps({"fused_adam": {"key": "k", "folder": str(store)}}))
    imported = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setattr(cpp, "_import_module_from_library",
                        lambda name, path, py: imported.append((name, (Path(path) / f"{name}.so").read_text())))
    assert runtime_state.preload_built_ops() == ["fused_adam"]
    assert imported == [("fused_adam", "the warm-up's build")]


def test_the_warm_up_builds_async_io_for_its_key_when_an_older_async_io_is_recorded(tmp_path, monkeypatch):
    """A cache from before a key change records an async_io build: preloading it before the new key's
    build put it in DeepSpeed's op cache, load() returned it, and the new key's store was left empty
    (CI, exit 1 in the warm-up). Only pin_memory may be loaded when async_io builds."""
    import torch.utils.cpp_extension as cpp
    from deepspeed.ops.op_builder.builder import OpBuilder

    from harness.launch import warmup

    ext = tmp_path / "ext"
    for name in ("pin_memory", "async_io"):
        (ext / name).mkdir(parents=True)
        (ext / name / f"{name}.so").write_text(f"{name} under an older key")
    (ext / "built-ops.json").write_text(json.dumps({n: {"key": "older", "folder": str(ext / n)}
                                                    for n in ("pin_memory", "async_io")}))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    def imported(name, path, py):
        module = type(sys)(name)
        module.__file__ = str(Path(path) / f"{name}.so")
        return module

    monkeypatch.setattr(cpp, "_import_module_from_library", imported)
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: None)
    monkeypatch.setattr(sys, "_deepspeed_pin_memory_op_module", None, raising=False)
    in_cache_at_build = {}

    def ensure_op(name, key, build):
        in_cache_at_build[name] = sorted(OpBuilder._loaded_ops)
        return "built"

    monkeypatch.setattr(buildenv, "ensure_op", ensure_op)
    warmup.build_ops(("PinMemoryBuilder", "AsyncIOBuilder"), say=lambda msg: None)
    assert in_cache_at_build == {"pin_memory": [], "async_io": ["pin_memory"]}
