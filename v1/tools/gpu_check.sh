#!/usr/bin/env bash
# `make gpu-check` without make or a venv: on a bare CUDA machine (python3 with torch, triton,
# transformers and xxhash; no network), install what the engine needs and the machine lacks
# from the wheels `make gpu-wheels` put in .whl/ (into a folder on PYTHONPATH), then run the
# check. Arguments go to `python -m v1.tools.gpu_check`; the exit code is the check's.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
SITE=${V1_GPU_SITE:-/tmp/v1-gpu-site}
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -m v1.tools.wheels install --wheels .whl --target "$SITE"
exec "$PYTHON" -m v1.tools.gpu_check "$@"
