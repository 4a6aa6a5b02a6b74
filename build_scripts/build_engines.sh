#!/usr/bin/env bash
# Build the TensorRT-LLM engines of one specdeploy build directory on a GPU host.
#
#   build_scripts/build_engines.sh build/<name> [container image]
#
# Runs build/<name>/engines/build_engines.sh (written by `specdeploy build`) inside NVIDIA's
# TensorRT-LLM container. The engine flow (trtllm-build) exists in TensorRT-LLM 0.15 - 1.3.x
# (deprecated from 1.2, removed for 1.4); the generated script checks the version and refuses
# anything else. Already inside such a container (trtllm-build on PATH)? The script is run
# directly, without docker. build_scripts/gpu_host.sh does this and then serves and verifies.
set -euo pipefail

BUILD_DIR="${1:?usage: build_engines.sh build/<name> [image]}"
IMAGE="${2:-${TRTLLM_IMAGE:-nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3}}"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
SCRIPT="$BUILD_DIR/engines/build_engines.sh"

[ -f "$SCRIPT" ] || { echo "no $SCRIPT: run \`specdeploy convert\` and \`specdeploy build\` first" >&2; exit 2; }
[ -d "$BUILD_DIR/trtllm_ckpt" ] || { echo "no $BUILD_DIR/trtllm_ckpt: run \`specdeploy convert\` first" >&2; exit 2; }

if command -v trtllm-build >/dev/null 2>&1; then
    exec bash "$SCRIPT"
fi

command -v docker >/dev/null 2>&1 || { echo "neither trtllm-build nor docker found: run this on a GPU host with NVIDIA's TensorRT-LLM container" >&2; exit 3; }
exec docker run --rm --gpus all --ipc=host \
    -v "$BUILD_DIR:/build" -w /build \
    -e CKPT_DIR=/build/trtllm_ckpt -e ENGINE_DIR=/build/engines \
    "$IMAGE" bash /build/engines/build_engines.sh
