#!/usr/bin/env bash
# Build the TensorRT-LLM engines of one specdeploy build directory on a GPU host.
#
#   build_scripts/build_engines.sh build/<name> [container image]
#
# Runs build/<name>/engines/build_engines.sh (written by `specdeploy build`) inside NVIDIA's
# TensorRT-LLM container. The engine flow (trtllm-build) exists in TensorRT-LLM 0.15 - 1.2.x
# (deprecated from 1.2, removed from 1.3.0rc22: docs/releases.md); the generated script checks the version and refuses
# anything else. The default image is the one the build's release names (TRTLLM_IMAGE, else
# triton_repo/gpu_routes.json's release.triton_image). Already inside such a container
# (trtllm-build on PATH)? The script is run directly, without docker. The engines are left
# owned by the user who runs this and readable by any user. build_scripts/gpu_host.sh does this
# and then serves and verifies.
set -euo pipefail

BUILD_DIR="${1:?usage: build_engines.sh build/<name> [image]}"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
SCRIPT="$BUILD_DIR/engines/build_engines.sh"
ROUTES="$BUILD_DIR/triton_repo/gpu_routes.json"

[ -f "$SCRIPT" ] || { echo "no $SCRIPT: run \`specdeploy convert\` and \`specdeploy build\` first" >&2; exit 2; }
[ -d "$BUILD_DIR/trtllm_ckpt" ] || { echo "no $BUILD_DIR/trtllm_ckpt: run \`specdeploy convert\` first" >&2; exit 2; }

if command -v trtllm-build >/dev/null 2>&1; then
    CKPT_DIR="$BUILD_DIR/trtllm_ckpt" ENGINE_DIR="$BUILD_DIR/engines" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 bash "$SCRIPT"
    exec chmod -R a+rX "$BUILD_DIR/engines"
fi

release_image() {
    [ -f "$ROUTES" ] || return 0
    python3 -c 'import json, sys; print((json.load(open(sys.argv[1])).get("release") or {}).get("triton_image") or "")' "$ROUTES"
}
IMAGE="${2:-${TRTLLM_IMAGE:-$(release_image)}}"
[ -n "$IMAGE" ] || { echo "no image known for this build's TensorRT-LLM release (see $ROUTES, release.triton_image_note): pass one" >&2; exit 9; }
command -v docker >/dev/null 2>&1 || { echo "neither trtllm-build nor docker found: run this on a GPU host with NVIDIA's TensorRT-LLM container" >&2; exit 3; }
# the container writes as root: the engines go back to the user who owns the build
exec docker run --rm --gpus all --ipc=host \
    -v "$BUILD_DIR:/build" -w /build \
    -e CKPT_DIR=/build/trtllm_ckpt -e ENGINE_DIR=/build/engines -e HF_HUB_OFFLINE=1 -e TRANSFORMERS_OFFLINE=1 \
    "$IMAGE" bash -c "bash /build/engines/build_engines.sh && chown -R $(id -u):$(id -g) /build/engines && chmod -R a+rX /build/engines"
