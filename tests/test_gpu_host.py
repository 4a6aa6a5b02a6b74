"""build_scripts/gpu_host.sh offline: valid bash, the exact container commands per route (dry
run), the refusals, and a build directory that still works after it moved (every generated path
resolves where the build now sits)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specdeploy.manifest import BuildDir
from specdeploy.triton import package
from specdeploy.trtllm import build as trt_build
from tests.test_triton_package import eagle3_module, new_build

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "build_scripts" / "gpu_host.sh"
IMAGE = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"


def gpu_host(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def packaged(root: Path, model: Path, kind: str, eagle: dict | None = None, **options) -> BuildDir:
    build = new_build(root, model, kind, eagle, **options)
    trt_build.run(build)
    package.run(build, spec=kind, max_draft_len=options.get("max_draft_len"))
    return build


def fake_container(tmp_path: Path) -> Path:
    """What NVIDIA's container holds in /app/all_models for the two routes."""
    models = tmp_path / "all_models"
    for folder, files in (("llmapi/tensorrt_llm/1", ("model.py", "helpers.py", "model.yaml")),
                          ("inflight_batcher_llm/tensorrt_llm_bls/1", ("model.py", "lib/decode.py"))):
        for name in files:
            (models / folder / name).parent.mkdir(parents=True, exist_ok=True)
            (models / folder / name).write_text(f"# upstream {name}\n")
    return models


@pytest.mark.parametrize("script", ["gpu_host.sh", "build_engines.sh"])
def test_scripts_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "build_scripts" / script)], capture_output=True).returncode == 0


def test_dry_run_llmapi_route_prints_the_exact_container_commands(tmp_path, tiny_llama_dir):
    build = packaged(tmp_path / "b", tiny_llama_dir, "eagle", eagle3_module(tiny_llama_dir))
    done = gpu_host("--dry-run", str(build.root))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"# route llmapi (TensorRT-LLM 1.2.1) of {build.root.resolve()}"
    assert lines[1] == (f"docker run --rm --gpus all --ipc=host --shm-size=2g --ulimit memlock=-1 -v {build.root.resolve()}:/build "
                        f"-v {ROOT}:/specdeploy {IMAGE} bash -c \"$PLAN\"")
    plan = lines[lines.index("# PLAN:") + 1:]
    expected = [
        "set -euo pipefail",
        "rm -rf /build/gpu_host/llmapi && mkdir -p /build/gpu_host/llmapi && cp -r /build/triton_repo/llmapi/. /build/gpu_host/llmapi/",
        # model.py AND helpers.py (everything but upstream's model.yaml, replaced by ours)
        "find /app/all_models/llmapi/tensorrt_llm/1 -mindepth 1 -maxdepth 1 ! -name model.yaml -exec cp -r {} /build/gpu_host/llmapi/tensorrt_llm/1/ \\;",
        "grep -rlF '$BUILD_DIR' /build/gpu_host/llmapi | xargs -r sed -i 's#\\$BUILD_DIR#/build#g'",
        "tritonserver --model-repository /build/gpu_host/llmapi --grpc-port 8001 --http-port 8000 --metrics-port 8002 "
        "> /build/gpu_host/llmapi.tritonserver.log 2>&1 & SERVER=$!",
        "cd /specdeploy && python3 -m specdeploy verify --build-dir /build --server trtllm --route llmapi --url 127.0.0.1:8001 --device cuda",
    ]
    for line in expected:
        assert line in plan, line
    assert not any("build_engines.sh" in line for line in plan)  # no engines on this route
    order = [plan.index(line) for line in expected]
    assert order == sorted(order)


def test_dry_run_engine_route_builds_engines_and_takes_the_bls_code(tmp_path, tiny_llama_dir, tiny_draft_dir):
    build = packaged(tmp_path / "b", tiny_llama_dir, "draft", draft_model=str(tiny_draft_dir), max_draft_len=3)
    done = gpu_host("--dry-run", "--route", "engine", str(build.root), "my/image:1")
    assert done.returncode == 0, done.stderr
    plan = done.stdout.splitlines()
    assert "my/image:1 bash -c" in plan[1]
    build_line = "CKPT_DIR=/build/trtllm_ckpt ENGINE_DIR=/build/engines bash /build/engines/build_engines.sh"
    bls_line = ("find /app/all_models/inflight_batcher_llm/tensorrt_llm_bls/1 -mindepth 1 -maxdepth 1 ! -name model.yaml "
                "-exec cp -r {} /build/gpu_host/engine/tensorrt_llm_bls/1/ \\;")
    verify_line = "cd /specdeploy && python3 -m specdeploy verify --build-dir /build --server trtllm --route engine --url 127.0.0.1:8001 --device cuda"
    assert plan.index(build_line) < plan.index(bls_line) < plan.index(verify_line)
    # the server is ready when the route's entry model is: the BLS model for draft-target
    assert any("v2/models/tensorrt_llm_bls/ready" in line for line in plan)


def test_refusals(tmp_path, tiny_llama_dir):
    build = packaged(tmp_path / "e", tiny_llama_dir, "eagle", eagle3_module(tiny_llama_dir))
    done = gpu_host("--dry-run", "--route", "engine", str(build.root))
    assert done.returncode == 5 and "no TensorRT-LLM route engine" in done.stderr and "EAGLE-3" in done.stderr
    wide = packaged(tmp_path / "n", tiny_llama_dir, "ngram", tp=2)
    done = gpu_host("--dry-run", str(wide.root))
    assert done.returncode == 6 and "--world_size 2" in done.stderr
    done = gpu_host("--dry-run", str(tmp_path))
    assert done.returncode == 2 and "gpu_routes.json" in done.stderr


def _resolved_paths(text: str, root: Path) -> list[Path]:
    return [Path(m) for m in re.findall(re.escape(str(root)) + r"[^\s\"',}\]]*", text)]


@pytest.mark.parametrize("kind", ["none", "draft"])
def test_a_moved_build_keeps_every_generated_path_valid(tmp_path, tiny_llama_dir, tiny_draft_dir, kind):
    options = {"draft_model": str(tiny_draft_dir), "max_draft_len": 3} if kind == "draft" else {}
    old = packaged(tmp_path / "old" / "b", tiny_llama_dir, kind, **options).root.resolve()
    new = tmp_path / "elsewhere" / "b"
    new.parent.mkdir()
    shutil.move(old, new)
    shutil.rmtree(tmp_path / "old")
    for path in [*(new / "triton_repo").rglob("*"), *(new / "trtllm_ckpt" / "llmapi").rglob("*.yaml"), new / "trtllm_ckpt" / "convert_summary.json"]:
        if path.is_file() and path.suffix in (".pbtxt", ".json", ".yaml", ".txt", ".md"):
            assert str(old) not in path.read_text(), path  # nothing names where the build was written
    # the CPU repository: relative to each model's folder / deployment.json's folder
    cpu = new / "triton_repo" / "cpu"
    config = json.loads((cpu / "tensorrt_llm" / "1" / "deployment.json").read_text())
    base = cpu / "tensorrt_llm" / "1"
    assert (base / config["model_dir"] / "config.json").exists()
    if kind == "draft":
        assert (base / config["spec"]["draft_model_dir"] / "config.json").exists()
    for model in ("preprocessing", "postprocessing"):
        text = (cpu / model / "config.pbtxt").read_text()
        rel = re.search(r'key: "tokenizer_dir" value: \{ string_value: "([^"]+)"', text).group(1)
        assert (cpu / model / rel / "tokenizer_config.json").exists(), model
    # the GPU repositories, assembled where the build now is
    env = {"SPECDEPLOY_ALL_MODELS": str(fake_container(tmp_path))}
    for route in ("engine", "llmapi"):
        done = gpu_host("--assemble", "--route", route, str(new), env=env)
        assert done.returncode == 0, done.stderr
        repo = new / "gpu_host" / route
        texts = [p.read_text() for p in repo.rglob("*") if p.is_file() and p.suffix in (".pbtxt", ".yaml", ".txt")]
        assert texts and not any("$BUILD_DIR" in t for t in texts)
        paths = [p for t in texts for p in _resolved_paths(t, new.resolve())]
        assert paths, route
        for path in paths:  # engines are built on the GPU host, into the build's engines/ folder
            assert path.exists() or path.parent == new.resolve() / "engines", path
    assert (new / "gpu_host" / "llmapi" / "tensorrt_llm" / "1" / "helpers.py").exists()
    assert (new / "gpu_host" / "engine" / "tensorrt_llm_bls" / "1" / "lib" / "decode.py").exists()
    assert (new / "gpu_host" / "llmapi" / "tensorrt_llm" / "1" / "model.yaml").read_text().startswith("model: ")  # ours, not upstream's
