"""The build directory, atomic writes, the CLI frame and choices trees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from specdeploy.choices import parse_choices, validate_choices
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import load_safetensors_dir
from specdeploy.manifest import BuildDir


def test_stage_completes_atomically_and_is_skipped_on_rerun(tmp_path):
    build = BuildDir(tmp_path / "b")
    assert not build.completed("resolve", {"model": "x"})
    with build.stage("resolve", "base", {"model": "x"}) as tmp:
        (tmp / "w.txt").write_text("weights")
        assert not build.path("base").exists()  # nothing visible until the stage completes
    assert build.completed("resolve", {"model": "x"})
    assert not build.completed("resolve", {"model": "y"})
    record = build.record("resolve")
    assert record["outputs"]["w.txt"]["bytes"] == 7


def test_interrupted_stage_leaves_no_artifact_and_reruns(tmp_path):
    build = BuildDir(tmp_path / "b")
    with pytest.raises(RuntimeError):
        with build.stage("resolve", "base", {}) as tmp:
            (tmp / "half.bin").write_bytes(b"xx")
            raise RuntimeError("killed mid-stage")
    assert not build.path("base").exists()
    assert build.record("resolve") is None
    with build.stage("resolve", "base", {}) as tmp:
        (tmp / "full.bin").write_bytes(b"xyz")
    assert sorted(p.name for p in build.path("base").iterdir()) == ["full.bin"]


def test_a_stage_killed_while_removing_the_old_output_leaves_the_new_one_in_place(tmp_path, monkeypatch):
    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {"v": 1}) as tmp:
        (tmp / "w").write_text("old")

    remove = shutil.rmtree

    def killed(path, *args, **kwargs):  # a kill while the old output is being deleted
        if path.name == ".base.stale" and path.exists():
            raise KeyboardInterrupt
        remove(path, *args, **kwargs)

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(shutil, "rmtree", killed)
        with build.stage("resolve", "base", {"v": 2}) as tmp:
            (tmp / "w").write_text("new")
    assert (build.path("base") / "w").read_text() == "new"
    assert (tmp_path / "b" / ".base.stale").exists()
    assert not build.completed("resolve", {"v": 2})  # not recorded: the rerun makes it again
    with build.stage("resolve", "base", {"v": 2}) as tmp:
        (tmp / "w").write_text("new")
    assert build.completed("resolve", {"v": 2}) and not (tmp_path / "b" / ".base.stale").exists()


def test_a_second_run_on_a_build_being_written_is_refused_with_the_first_ones_pid(tmp_path):
    build, again = BuildDir(tmp_path / "b"), BuildDir(tmp_path / "b")
    with build.stage("quantize", "quantized", {}) as tmp:
        (tmp / "q").write_text("first")
        with pytest.raises(SpecDeployError, match=rf"another specdeploy run is writing .*\(pid {os.getpid()}, stage "
                                                  r"quantize\): stage 'package' was not started"):
            with again.stage("package", "triton_repo", {}):
                pass
        assert (tmp / "q").exists()  # the first run's work is untouched
    assert build.completed("quantize", {}) and build.record("package") is None
    with again.stage("package", "triton_repo", {}) as tmp:  # free once the first run's stage ended
        (tmp / "p").write_text("second")
    assert build.completed("package", {})
    (tmp_path / "taken").write_text("a file where the build would be")  # as unwritable as a read-only mount
    with pytest.raises(SpecDeployError, match=r"cannot write .*taken \(File exists\): stage 'resolve' was not started"):
        with BuildDir(tmp_path / "taken").stage("resolve", "base", {}):
            pass


def test_a_shared_build_locks_through_a_lock_file_another_user_made(tmp_path, monkeypatch, capsys):
    """Another user's 0644 .lock in a build both may write: locked read-only (flock needs no write
    access); and a file system without locks (ENOLCK) runs the stage with a warning."""
    import errno

    from specdeploy import manifest

    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {}) as tmp:
        (tmp / "a").write_text("1")
    owner = (tmp_path / "b" / ".lock").read_text()

    def as_another_user(path, mode="r", *args, **kwargs):
        if "+" in mode or "w" in mode or "a" in mode:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return open(path, mode, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(manifest, "open", as_another_user, raising=False)
        with build.stage("quantize", "quantized", {}) as tmp:
            (tmp / "q").write_text("q")
            with pytest.raises(SpecDeployError, match="another specdeploy run is writing"):  # and it is held
                with BuildDir(tmp_path / "b").stage("package", "triton_repo", {}):
                    pass
    assert build.completed("quantize", {}) and (tmp_path / "b" / ".lock").read_text() == owner

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(manifest.fcntl, "flock", no_locks)
    with build.stage("package", "triton_repo", {}) as tmp:
        (tmp / "p").write_text("p")
    assert build.completed("package", {}) and "cannot be locked (No locks available)" in capsys.readouterr().err


def test_downstream_stage_reruns_when_its_input_changes(tmp_path):
    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {}) as tmp:
        (tmp / "a").write_text("1")
    with build.stage("quantize", "quantized", {"q": "fp8"}, consumes=("resolve",)) as tmp:
        (tmp / "q").write_text("q")
    assert build.completed("quantize", {"q": "fp8"}, consumes=("resolve",))
    with build.stage("resolve", "base", {}) as tmp:
        (tmp / "a").write_text("2")
    assert not build.completed("quantize", {"q": "fp8"}, consumes=("resolve",))


def test_deleted_output_makes_stage_incomplete(tmp_path):
    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {}) as tmp:
        (tmp / "a").write_text("1")
    (build.path("base") / "a").unlink()
    assert not build.completed("resolve", {})


def test_choices_tree_valid_and_pbtxt_round_trip():
    tree = validate_choices([[1], [0], [0, 0], [0, 1]], max_depth=2, max_draft_len=4)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1))
    assert tree.parents() == [-1, -1, 0, 0]
    assert validate_choices(tree.to_pbtxt()).paths == tree.paths
    assert parse_choices("[[0], [0, 0]]") == [[0], [0, 0]]


@pytest.mark.parametrize(
    "choices, kwargs, message",
    [
        ([], {}, "empty"),
        ([[0], [0]], {}, "appears twice"),
        ([[0], [1, 0]], {}, "no parent [1]"),
        ([[0], [0, 0], [0, 0, 0]], {"max_depth": 2}, "only 2 heads"),
        ([[0], [1], [2]], {"max_draft_len": 2}, "exceed max_draft_len 2"),
        ([[0], [-1]], {}, "not a top-k index"),
        ("{0}, {0, ", {}, "cannot parse"),
    ],
)
def test_choices_tree_errors_name_the_problem(choices, kwargs, message):
    with pytest.raises(SpecDeployError, match=message.replace("[", r"\[")):
        validate_choices(choices, **kwargs)


def test_cli_help_lists_every_stage():
    out = subprocess.run([sys.executable, "-m", "specdeploy", "--help"], capture_output=True, text=True, check=True)
    for command in ("engine", "resolve", "quantize", "convert", "build", "package", "serve", "verify", "bench"):
        assert command in out.stdout


def test_a_checkpoint_folder_loads_the_shards_its_index_names_not_every_safetensors(tmp_path):
    """Mistral's repositories ship consolidated.safetensors (the same model in another layout) beside
    the HF shards: only the checkpoint's own tensors load, as transformers reads them."""
    from safetensors.torch import save_file

    save_file({"layers.0.attention.wq.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    save_file({"model.embed_tokens.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert list(load_safetensors_dir(tmp_path, hint="-")) == ["model.embed_tokens.weight"]
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    save_file({"lm_head.weight": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(load_safetensors_dir(tmp_path, hint="-")) == ["lm_head.weight", "model.embed_tokens.weight"]
    # an unsharded re-save leaves the old index behind: transformers reads model.safetensors first
    save_file({"model.norm.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert list(load_safetensors_dir(tmp_path, hint="-")) == ["model.norm.weight"]
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SpecDeployError, match="names shards that are not there: model-00002-of-00002"):
        load_safetensors_dir(tmp_path, hint="-")
    (tmp_path / "model.safetensors.index.json").unlink()  # consolidated.safetensors and a stray shard: no checkpoint
    with pytest.raises(SpecDeployError, match="no model.safetensors"):
        load_safetensors_dir(tmp_path, hint="-")

