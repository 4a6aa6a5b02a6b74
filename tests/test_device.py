"""Devices, the memory preflight and content-keyed caches: the parts every stage shares."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from specdeploy import device as D
from specdeploy import preflight
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import cached_sha256, content_fingerprint, sha256_file
from specdeploy.manifest import BuildDir


def test_auto_resolves_to_what_torch_sees():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert D.resolve_device("auto").type == expected
    assert D.resolve_device("cpu") == torch.device("cpu")
    assert D.resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_without_a_gpu_is_refused_with_the_way_out():
    with pytest.raises(SpecDeployError, match="sees no CUDA device") as err:
        D.resolve_device("cuda:0")
    assert "--device cpu" in err.value.hint


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:-1", "tpu"])
def test_device_spelling_is_checked_at_parse_time(bad):
    parser = argparse.ArgumentParser()
    D.add_device_arg(parser)
    assert parser.parse_args(["--device", "CUDA:1"]).device == "cuda:1"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", bad])


def test_frozen_dtype_is_bf16_only_on_gpu():
    assert D.frozen_dtype(torch.device("cpu")) == torch.float32
    assert D.frozen_dtype(torch.device("cuda", 0)) == torch.bfloat16


def test_world_reads_torchrun_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert D.world() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert D.world() == (3, 4)


def _weights(folder, shapes):
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"w{i}": torch.zeros(shape) for i, shape in enumerate(shapes)}, str(folder / "model.safetensors"))
    return folder


def test_parameter_count_reads_safetensors_headers(tmp_path):
    folder = _weights(tmp_path / "m", [(3, 4), (5,), (2, 2, 2)])
    assert preflight.parameter_count(folder) == 12 + 5 + 8
    assert preflight.weights_bytes(folder, "bfloat16") == 25 * 2


def test_parameter_count_reads_the_checkpoints_own_files(tmp_path):
    """Not Mistral's consolidated.safetensors beside model.safetensors: the same model counted twice."""
    folder = _weights(tmp_path / "m", [(6, 4)])
    save_file({"layers.0.attention.wq.weight": torch.zeros(6, 4)}, str(folder / "consolidated.safetensors"))
    assert preflight.parameter_count(folder) == 24


def test_preflight_refuses_over_budget_naming_the_options(monkeypatch):
    monkeypatch.setenv(preflight.BUDGET_ENV, "1")
    plan = preflight.MemoryPlan("calibration", {"weights": 3 * preflight.GiB, "activations": preflight.GiB // 2})
    with pytest.raises(SpecDeployError, match=r"calibration needs ~3\.5 GiB .*has 1\.0 GiB free") as err:
        preflight.check(plan, torch.device("cpu"), options=["device_map auto", "fewer samples"])
    assert "device_map auto" in err.value.hint and "fewer samples" in err.value.hint
    preflight.check(preflight.MemoryPlan("tiny", {"weights": 1 << 20}), torch.device("cpu"), options=["x"])


def test_cached_sha256_follows_content_not_size(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "w.bin"
    path.write_bytes(b"a" * 64)
    first = cached_sha256(path)
    assert first == sha256_file(path)
    assert cached_sha256(path) == first  # served from the memo
    path.write_bytes(b"b" * 64)  # same size, new content (and a new mtime)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert cached_sha256(path) == sha256_file(path) != first
    assert content_fingerprint(tmp_path, (".bin",)) == {"w.bin": sha256_file(path)}


def test_same_size_rewrite_makes_stage_incomplete(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {}, device="cpu (2 threads)") as tmp:
        (tmp / "w").write_text("1111")
    assert build.record("resolve")["device"] == "cpu (2 threads)"
    assert build.completed("resolve", {})
    target = build.path("base") / "w"
    target.write_text("2222")
    os.utime(target, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns + 1_000_000))
    assert not build.completed("resolve", {})


def test_cli_version(monkeypatch):
    out = subprocess.run([sys.executable, "-m", "specdeploy", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("specdeploy ") and out.stdout.split()[1][0].isdigit()
    from importlib import metadata

    from specdeploy import __version__, cli

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)  # a source tree on PYTHONPATH (NVIDIA's containers)
    assert cli._version() == f"{__version__} (source tree, not installed)"


def test_the_fast_dtype_is_bf16_only_where_it_is_native(monkeypatch, tmp_path, capsys):
    from specdeploy.device import fast_dtype, native_bf16
    from specdeploy.triton.cpu_repo import serve_dtype

    cpu = torch.device("cpu")
    monkeypatch.setenv("SPECDEPLOY_CPU_BF16", "1")
    assert native_bf16(cpu) and fast_dtype(cpu) == "bfloat16" and serve_dtype("native", tmp_path, "cpu") == "bfloat16"
    monkeypatch.setenv("SPECDEPLOY_CPU_BF16", "0")
    assert fast_dtype(cpu) == "float32" and serve_dtype("native", tmp_path, "cpu") == "float32"
    assert "no native bf16" in capsys.readouterr().out  # said plainly, with the way to force it
    assert serve_dtype("bfloat16", tmp_path, "cpu") == "bfloat16"  # an explicit choice is kept
    assert serve_dtype("auto", tmp_path, "cpu") == "float32"  # unquantized: exact in float32


AMD = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
INTEL = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 avx512f\n"


def test_mkl_takes_its_avx2_path_on_amd_only_and_a_users_choice_is_kept(monkeypatch):
    from specdeploy import device

    assert device.mkl_code_path(AMD) == "AVX2"
    assert device.mkl_code_path(INTEL) is None  # MKL's own dispatch
    assert device.mkl_code_path(AMD.replace(" avx2", "")) is None  # no AVX2 path to take
    assert device.mkl_code_path("") is None  # no /proc/cpuinfo (macOS, Windows)
    monkeypatch.setattr(device, "_cpuinfo", lambda: AMD)
    env: dict[str, str] = {}
    device.tune_cpu_blas(env)
    assert env == {"MKL_CBWR": "AVX2"}
    env = {"MKL_CBWR": "COMPATIBLE"}
    device.tune_cpu_blas(env)
    assert env == {"MKL_CBWR": "COMPATIBLE"}

