#!/usr/bin/env bash
# One command on a GPU host: serve a specdeploy build on NVIDIA's TensorRT-LLM Triton container
# and verify it. The plan is build_scripts/gpu_host.py (standard library only, so it runs before
# anything is installed on the host); see its --help and build_scripts/README.md.
#
#   build_scripts/gpu_host.sh [--dry-run | --assemble | --serve-only] [--route engine|llmapi] build/<name> [image]
set -euo pipefail

PYTHON="$(command -v python3 || true)"
if [ -z "$PYTHON" ] || ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 8))'; then
    echo "gpu_host.sh needs python3 >= 3.8 on PATH (the host's own; nothing else is needed to plan)" >&2
    exit 2
fi
exec "$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/gpu_host.py" "$@"
