"""`pip install .` (not editable) gives a working `specdeploy package`: the wheel carries the Triton
model-repository templates (package data), and a build packaged by the installed wheel, run from
outside the repository in a fresh virtual environment that cannot see the source tree, has every
template file and the preprocessing model's own copy of specdeploy/prompts.py, and whose CPU tensorrt_llm
model finds the code it runs (specdeploy.triton.serving) in the installed package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "specdeploy" / "triton" / "templates"
SOURCES = ("pyproject.toml", "README.md", "specdeploy")  # what the wheel is built from
CPU_MODELS = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls")
# the template files the CPU repository takes as they are (config.pbtxt files are filled)
CPU_CODE = {
    "preprocessing/1/model.py": "inflight_batcher_llm/preprocessing/1/model.py",
    "postprocessing/1/model.py": "inflight_batcher_llm/postprocessing/1/model.py",
    "tensorrt_llm/1/model.py": "cpu/tensorrt_llm/1/model.py",
    "tensorrt_llm_bls/1/model.py": "cpu/tensorrt_llm_bls/1/model.py",
}
# run by the fresh environment's interpreter: where specdeploy and its templates come from
WHERE = """
import json, sys
import specdeploy
from specdeploy.triton.templating import TEMPLATES
print(json.dumps({"specdeploy": specdeploy.__file__, "templates": str(TEMPLATES),
                  "finders": [type(f).__module__ if not isinstance(f, type) else f.__module__ for f in sys.meta_path]}))
"""
# the packaged preprocessing model as Triton's stub loads it: its folder on sys.path, nothing else
PREPROCESSING = """
import importlib.util, json, sys, types
folder = sys.argv[1]
sys.path.insert(0, folder)
sys.modules["triton_python_backend_utils"] = types.SimpleNamespace()
spec = importlib.util.spec_from_file_location("preprocessing_model", folder + "/model.py")
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(json.dumps({"specdeploy_prompts": sys.modules["specdeploy_prompts"].__file__}))
"""
# the packaged tensorrt_llm model as Triton's stub loads it (a stand-in for pb_utils): the serving
# code it imports comes from the installed package
TENSORRT_LLM = """
import importlib.util, json, sys, types
sys.modules["triton_python_backend_utils"] = types.SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)
spec = importlib.util.spec_from_file_location("tensorrt_llm_model", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
print(json.dumps({"serving": sys.modules["specdeploy.triton.serving.scheduler"].__file__}))
"""


def run(args: list, *, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def dependency_paths() -> list[str]:
    """This interpreter's import path, less every folder holding a `specdeploy` (the source tree,
    or an editable install's): the fresh environment gets the dependencies, never the project."""
    return [p for p in dict.fromkeys(sys.path) if p and Path(p).is_dir() and not (Path(p) / "specdeploy").exists()]


def test_the_installed_wheel_packages_a_build_outside_the_repository(tmp_path, tiny_llama_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               SPECDEPLOY_CACHE=str(tmp_path / "cache"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert ROOT not in elsewhere.resolve().parents

    # the wheel, from a copy of the sources: setuptools writes build/ and *.egg-info beside them
    # (build/ is the project's build root)
    src = tmp_path / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        elif (ROOT / name).exists():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src],
        env=env, cwd=elsewhere)
    (wheel,) = dist.glob("specdeploy-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"specdeploy/triton/templates/{p.relative_to(TEMPLATES)}" for p in TEMPLATES.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    assert wanted and wanted <= names, f"the wheel lacks the templates: {sorted(wanted - names)}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]

    # a fresh environment: the wheel installed, the project's dependencies appended by a .pth (no
    # .pth of theirs runs, so an editable install's finder is never installed)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], env=env, cwd=elsewhere)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=env, cwd=elsewhere).strip())
    assert site != Path(sysconfig.get_path("purelib"))
    (site / "specdeploy_test_dependencies.pth").write_text("".join(f"{p}\n" for p in dependency_paths()))
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        env=env, cwd=elsewhere)
    where = json.loads(run([python, "-c", WHERE], env=env, cwd=elsewhere))
    assert Path(where["specdeploy"]) == site / "specdeploy" / "__init__.py"
    assert Path(where["templates"]) == site / "specdeploy" / "triton" / "templates"
    assert not [f for f in where["finders"] if "editable" in f], where["finders"]

    # `specdeploy package` of the installed wheel, run from outside the repository
    build = tmp_path / "build" / "tiny"
    specdeploy = venv / "bin" / "specdeploy"
    run([specdeploy, "resolve", "--build-dir", build, "--model", tiny_llama_dir], env=env, cwd=elsewhere)
    run([specdeploy, "package", "--build-dir", build, "--spec", "ngram", "--max-draft-len", "2", "--device", "cpu",
         "--dtype", "float32"], env=env, cwd=elsewhere)

    repo = build / "triton_repo" / "cpu"
    for model in CPU_MODELS:
        assert (repo / model / "config.pbtxt").is_file(), model
    for written, template in CPU_CODE.items():
        assert (repo / written).read_bytes() == (TEMPLATES / template).read_bytes(), written
    prompts = repo / "preprocessing" / "1" / "specdeploy_prompts.py"
    assert prompts.read_bytes() == (ROOT / "specdeploy" / "prompts.py").read_bytes()
    assert not [p for p in repo.rglob("*") if p.is_symlink()], "the written repository must be self-contained"
    # and the preprocessing model finds that copy in its own folder, as Triton's stub loads it
    loaded = json.loads(run([python, "-c", PREPROCESSING, repo / "preprocessing" / "1"], env=env, cwd=elsewhere))
    assert Path(loaded["specdeploy_prompts"]) == prompts
    model = json.loads(run([python, "-c", TENSORRT_LLM, repo / "tensorrt_llm" / "1" / "model.py"], env=env, cwd=elsewhere))
    assert Path(model["serving"]) == site / "specdeploy" / "triton" / "serving" / "scheduler.py"
