"""triton_repo/gpu_routes.json and triton_repo/README.md: which GPU routes a packaged build has
(TensorRT-LLM's engine and llmapi; vLLM and SGLang under "engines"), which TensorRT-LLM route to
run, what each needs on a GPU host and the releases they were written for; read back by
build_scripts/gpu_host.sh, `specdeploy verify --server trtllm` and `make engine`'s summary. Paths
are `$BUILD_DIR/...`, resolved where the build is mounted. write_gpu_routes writes it all at package
time, the vLLM and SGLang folders included (specdeploy/engines/routes.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdeploy.engines.routes import SCRIPT, write_engine_routes
from specdeploy.errors import SpecDeployError
from specdeploy.fileio import atomic_write_json, atomic_write_text
from specdeploy.manifest import BuildDir
from specdeploy.trtllm.hostpaths import resolve
from specdeploy.trtllm.llmapi import DraftStructure
from specdeploy.trtllm.releases import DEFAULT_TRTLLM_VERSION, release_for
from specdeploy.triton.cpu_plan import PLAN_FILE
from specdeploy.triton.engine_repo import BLS_CONTAINER_DIR
from specdeploy.triton.llmapi_repo import LLMAPI_CONTAINER_DIR

OUT = "triton_repo"  # the package stage's folder in the build: the routes' paths start there
ROUTES_FILE = "gpu_routes.json"


def write_gpu_routes(tmp: Path, build: BuildDir, kind: str, converted: dict[str, Any] | None,
                     structure: DraftStructure | None, settings: dict[str, Any], knobs: dict[str, Any] | None,
                     model_dir: Path) -> dict[str, Any]:
    """The package stage's last writer: tmp/{vllm,sglang}/ (engines.routes), tmp/gpu_routes.json and
    tmp/README.md, as they will be once tmp is published as build/<name>/triton_repo."""
    draft = settings.get("draft_model_dir")  # $BUILD_DIR/... for the draft the build carries
    engines = write_engine_routes(tmp, build, kind, structure, model_dir=model_dir, published=build.root.resolve() / OUT,
                                  draft_model=Path(resolve(draft, build.root)) if draft else None, tp=(converted or {}).get("tp_size", 1),
                                  pp=(converted or {}).get("pp_size", 1))
    routes = routes_json(kind, converted, structure, settings, knobs, engines=engines)
    atomic_write_json(tmp / ROUTES_FILE, routes)
    atomic_write_text(tmp / "README.md", readme(routes))
    return routes


def routes_json(kind: str, converted: dict[str, Any] | None, structure: DraftStructure | None, settings: dict[str, Any],
                knobs: dict[str, Any] | None = None,
                engines: tuple[dict[str, Any], dict[str, str]] | None = None) -> dict[str, Any]:
    """gpu_routes.json: the GPU routes this build has, the one to run, what each needs on the host,
    and the release they were written for (its image, pins and serve flag); with `engines` (the
    vLLM and SGLang routes and refusals engines.routes wrote) those too."""
    converted = converted or {}
    world = converted.get("tp_size", 1) * converted.get("pp_size", 1)
    routes: dict[str, Any] = {}
    if converted.get("llmapi"):
        routes["llmapi"] = {
            "repo": f"{OUT}/llmapi", "model": "tensorrt_llm", "inputs": "llmapi", "stream": settings["decoupled"],
            "world_size": world, "request": {},
            # model.yaml's triton_config.decoupled, stated in the assembled config.pbtxt too: only
            # model.py's auto_complete_config applies it, and NVIDIA's launch_triton_server.py turns that off
            "decoupled": settings["decoupled"],
            "container_files": {"from": LLMAPI_CONTAINER_DIR, "to": "tensorrt_llm", "except": ["1/model.yaml"]},
            "trtllm_serve": {"model": converted["llmapi"]["model"], "config": f"{OUT}/llmapi/trtllm_serve.yaml"},
            "speculation_knobs": {"values": knobs or {}, "from": "the CPU planner's measured break-even "
                                  f"({OUT}/cpu/{PLAN_FILE}): starting points; a GPU's costs differ"},
        }
    if converted.get("engine_flow"):
        bls = kind == "draft"  # draft-target runs in the BLS model: only with num_draft_tokens, never streaming
        routes["engine"] = {
            "repo": f"{OUT}/engine", "model": "tensorrt_llm_bls" if bls else "ensemble", "inputs": "ensemble",
            "stream": settings["decoupled"] and not bls, "world_size": world,
            "request": {"num_draft_tokens": structure.max_draft_len} if bls else {},
            "container_files": {"from": BLS_CONTAINER_DIR, "to": "tensorrt_llm_bls/1", "except": []},
            "build_engines": "engines/build_engines.sh",
        }
    recommended = next((r for r in ("llmapi", "engine") if r in routes), None)
    version = converted.get("trtllm_version") or DEFAULT_TRTLLM_VERSION
    written = {
        "trtllm_version": version, "release": release_for(version).as_dict(),
        "kind": kind, "recommended": recommended, "routes": routes,
        "refused": {name: converted.get(f"{name}_reason") for name in ("engine", "llmapi") if name not in routes},
        "structure": structure.as_dict() if structure else None,
        "note": "paths are $BUILD_DIR/...: build_scripts/gpu_host.sh resolves them where the build is mounted",
    }
    if engines is not None:  # beside TensorRT-LLM's routes: gpu_host.sh runs those, a user runs these
        written["engines"], written["engines_refused"] = engines
    return written


def gpu_routes(build: BuildDir) -> dict[str, Any]:
    """The packaged build's gpu_routes.json (see routes_json)."""
    path = build.path(OUT) / ROUTES_FILE
    if not path.exists():
        raise SpecDeployError(f"{path} not found", hint="run `specdeploy package` (or `make engine`) first")
    return json.loads(path.read_text())


def gpu_summary(build: BuildDir) -> list[str]:
    """What a GPU host should run for this build, one line each (for `make engine`'s summary)."""
    routes = gpu_routes(build)
    lines = []
    if routes["recommended"]:
        release = routes["release"]
        image = release["triton_image"] or f"none published ({release['triton_image_note']})"
        lines.append(f"GPU host (TensorRT-LLM {release['version']}, image {image}): build_scripts/gpu_host.sh {build.root} "
                     f"(route {routes['recommended']}: {', '.join(routes['routes'])} packaged in {build.path(OUT)})")
    else:
        lines.append("No TensorRT-LLM route for this build: nothing to run on a GPU host")
    lines += [f"no {name} route: {why}" for name, why in routes["refused"].items() if why]
    lines += [f"{route['release']['engine']} {route['release']['version']}: {resolve(route['script'], build.root)}"
              for route in routes.get("engines", {}).values()]
    lines += [f"no {name} route: {why}" for name, why in routes.get("engines_refused", {}).items()]
    return lines


def readme(routes: dict[str, Any]) -> str:
    """triton_repo/README.md: what each repository is and where it runs."""
    lines = ["# Triton model repositories (written by `specdeploy package`)", "",
             "- `cpu/`: served here by `specdeploy serve` (Python backend, specdeploy runtime); paths relative to each model."]
    if "engine" in routes["routes"]:
        lines.append("- `engine/`: TensorRT-LLM engine flow (1.1 / 1.2, C++ `tensorrtllm` backend). Engines come from "
                     "`engines/build_engines.sh`; `tensorrt_llm_bls/1/` takes the container's BLS code "
                     f"({BLS_CONTAINER_DIR}). `fill_template_args.txt` holds the values in fill_template.py's syntax.")
        if routes["routes"]["engine"]["model"] == "tensorrt_llm_bls":
            lines.append("  Draft-target runs in `tensorrt_llm_bls`: send `num_draft_tokens` "
                         f"({routes['routes']['engine']['request']['num_draft_tokens']}) with each request; it does not stream.")
    if "llmapi" in routes["routes"]:
        lines.append(f"- `llmapi/`: TensorRT-LLM's LLM API (PyTorch backend): copy everything in {LLMAPI_CONTAINER_DIR} but "
                     "1/model.yaml (config.pbtxt; model.py, which imports helpers.py) into `llmapi/tensorrt_llm/`; "
                     "`trtllm_serve.yaml` is the same "
                     f"configuration for `trtllm-serve {routes['release']['serve_flag']}` (gpu_host.sh --assemble writes it "
                     "with its paths resolved).")
    lines += [f"- no `{name}/`: {why}" for name, why in routes["refused"].items() if why]
    for name, route in routes.get("engines", {}).items():
        release = route["release"]
        lines.append(f"- `{name}/`: {release['engine']} {release['version']} (`pip install {release['install']}`) drafts with "
                     f"`{route['module']}`; `{name}/{SCRIPT}` runs `{route['command']}`.")
        lines += [f"  Note: {note}" for note in route["notes"]]
    lines += [f"- no `{name}/`: {why}" for name, why in routes.get("engines_refused", {}).items()]
    lines += ["", "GPU-side paths read `$BUILD_DIR/...`: `build_scripts/gpu_host.sh build/<name>` resolves them where the "
              "build is mounted, assembles the repository, starts the server and runs `specdeploy verify` against it "
              "(`--dry-run` prints the commands)."]
    return "\n".join(lines) + "\n"
