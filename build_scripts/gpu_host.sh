#!/usr/bin/env bash
# One command on a GPU host: prove a specdeploy build on TensorRT-LLM.
#
#   build_scripts/gpu_host.sh [--dry-run | --assemble] [--route engine|llmapi] build/<name> [image]
#
# Reads build/<name>/triton_repo/gpu_routes.json (written by `specdeploy package`), then, for the
# route it recommends (or --route):
#   1. engine route: builds the engines (engines/build_engines.sh, trtllm-build);
#   2. assembles the Triton repository in build/<name>/gpu_host/<route>/: a copy of
#      triton_repo/<route>, the code NVIDIA's container ships for it (the llmapi model's model.py
#      and helpers.py; the BLS model), every `$BUILD_DIR` resolved to where the build is mounted;
#   3. starts tritonserver on it, runs `specdeploy verify --server trtllm` against it (reference
#      on the GPU), writes build/<name>/reports_gpu/, and stops the server.
# Inside NVIDIA's container (tritonserver and tensorrt_llm present) it runs there; elsewhere through
# docker with the build mounted at /build and this project at /specdeploy.
#   --dry-run   print the exact commands (and the docker command) without running anything
#   --assemble  only step 2, here, without docker or a GPU (to inspect the repository)
# Environment: TRTLLM_IMAGE (default image), GRPC_PORT/HTTP_PORT/METRICS_PORT (8001/8000/8002),
# SPECDEPLOY_ALL_MODELS (the container's /app/all_models).
set -euo pipefail

usage() { echo "usage: $0 [--dry-run | --assemble] [--route engine|llmapi] build/<name> [image]" >&2; exit 2; }
MODE=run
ROUTE=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) MODE=dry-run ;;
        --assemble) MODE=assemble ;;
        --route) ROUTE="${2:?--route needs engine or llmapi}"; shift ;;
        -h|--help) usage ;;
        *) ARGS+=("$1") ;;
    esac
    shift
done
[ ${#ARGS[@]} -ge 1 ] || usage
BUILD="$(cd "${ARGS[0]}" && pwd)"
IMAGE="${ARGS[1]:-${TRTLLM_IMAGE:-nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3}}"
PROJECT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ALL_MODELS="${SPECDEPLOY_ALL_MODELS:-/app/all_models}"
GRPC_PORT="${GRPC_PORT:-8001}" HTTP_PORT="${HTTP_PORT:-8000}" METRICS_PORT="${METRICS_PORT:-8002}"
case "$BUILD$PROJECT" in *[[:space:]]*) echo "paths with spaces are not supported: $BUILD, $PROJECT" >&2; exit 2 ;; esac
ROUTES="$BUILD/triton_repo/gpu_routes.json"
[ -f "$ROUTES" ] || { echo "no $ROUTES: run \`specdeploy package\` (or \`make engine\`) first" >&2; exit 2; }

# field KEY...: one value of gpu_routes.json (dotted path), printed as text or JSON
field() {
    python3 - "$ROUTES" "$1" <<'PY'
import json, sys
value = json.load(open(sys.argv[1]))
for key in sys.argv[2].split("."):
    value = value.get(key) if isinstance(value, dict) else None
print(value if isinstance(value, (str, int)) or value is None else json.dumps(value))
PY
}

ROUTE="${ROUTE:-$(field recommended)}"
if [ "$ROUTE" = "None" ] || [ "$(field "routes.$ROUTE")" = "None" ]; then
    echo "this build has no TensorRT-LLM route ${ROUTE}: $(field refused)" >&2
    exit 5
fi
WORLD="$(field "routes.$ROUTE.world_size")"
if [ "$WORLD" != "1" ]; then
    echo "route $ROUTE needs $WORLD GPUs (tp x pp): serve it with NVIDIA's /app/scripts/launch_triton_server.py --world_size $WORLD" >&2
    echo "on the repository --assemble writes; this script serves single-GPU deployments" >&2
    exit 6
fi

IN_CONTAINER=0
if command -v tritonserver >/dev/null 2>&1 && python3 -c "import tensorrt_llm" >/dev/null 2>&1; then IN_CONTAINER=1; fi
if [ "$MODE" = assemble ] || [ "$IN_CONTAINER" = 1 ]; then B="$BUILD" P="$PROJECT"; else B=/build P=/specdeploy; fi
W="$B/gpu_host/$ROUTE"
CONTAINER_FROM="$(field "routes.$ROUTE.container_files.from" | sed "s#^/app/all_models#$ALL_MODELS#")"
CONTAINER_TO="$(field "routes.$ROUTE.container_files.to")"
ENTRY="$(field "routes.$ROUTE.model")"

# the commands, one per line, with every path as the commands see it
assemble_plan() {
    echo "test -d $CONTAINER_FROM || { echo '$CONTAINER_FROM not found: run inside the TensorRT-LLM Triton container (or set SPECDEPLOY_ALL_MODELS)' >&2; exit 7; }"
    echo "rm -rf $W && mkdir -p $W && cp -r $B/$(field "routes.$ROUTE.repo")/. $W/"
    echo "find $CONTAINER_FROM -mindepth 1 -maxdepth 1 ! -name model.yaml -exec cp -r {} $W/$CONTAINER_TO/ \\;"
    echo "grep -rlF '\$BUILD_DIR' $W | xargs -r sed -i 's#\\\$BUILD_DIR#$B#g'"
}

full_plan() {
    echo "set -euo pipefail"
    if [ "$ROUTE" = engine ]; then
        echo "CKPT_DIR=$B/trtllm_ckpt ENGINE_DIR=$B/engines bash $B/$(field "routes.$ROUTE.build_engines")"
    fi
    assemble_plan
    echo "python3 -c 'import specdeploy, tritonclient.grpc' 2>/dev/null || { python3 -m pip install -q -e $P && python3 -m pip install -q --no-deps -r $P/requirements-data.txt; }"
    echo "tritonserver --model-repository $W --grpc-port $GRPC_PORT --http-port $HTTP_PORT --metrics-port $METRICS_PORT > $W.tritonserver.log 2>&1 & SERVER=\$!"
    echo "trap 'kill \$SERVER 2>/dev/null; wait \$SERVER 2>/dev/null || true' EXIT"
    echo "python3 -c 'import sys, time, urllib.request as u; t = time.time() + 1800
while time.time() < t:
    try: u.urlopen(\"http://127.0.0.1:$HTTP_PORT/v2/models/$ENTRY/ready\", timeout=5); sys.exit(0)
    except Exception: time.sleep(2)
sys.exit(\"tritonserver did not get $ENTRY ready: see $W.tritonserver.log\")'"
    echo "cd $P && python3 -m specdeploy verify --build-dir $B --server trtllm --route $ROUTE --url 127.0.0.1:$GRPC_PORT --device cuda"
}

docker_command() {
    echo "docker run --rm --gpus all --ipc=host --shm-size=2g --ulimit memlock=-1 -v $BUILD:/build -v $PROJECT:/specdeploy $IMAGE bash -c \"\$PLAN\""
}

case "$MODE" in
    assemble)
        assemble_plan | bash -euo pipefail
        echo "assembled $W (route $ROUTE)"
        ;;
    dry-run)
        echo "# route $ROUTE (TensorRT-LLM $(field trtllm_version)) of $BUILD"
        if [ "$IN_CONTAINER" = 0 ]; then docker_command; echo "# PLAN:"; fi
        full_plan
        ;;
    run)
        PLAN="$(full_plan)"
        if [ "$IN_CONTAINER" = 1 ]; then
            exec bash -c "$PLAN"
        fi
        command -v docker >/dev/null 2>&1 || { echo "neither NVIDIA's container tools nor docker found: run this on a GPU host" >&2; exit 3; }
        exec docker run --rm --gpus all --ipc=host --shm-size=2g --ulimit memlock=-1 \
            -v "$BUILD:/build" -v "$PROJECT:/specdeploy" "$IMAGE" bash -c "$PLAN"
        ;;
esac
