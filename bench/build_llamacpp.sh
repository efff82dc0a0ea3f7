#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only, Release, static llama/ggml libs) from the
# llama.cpp source vendored in the llama-cpp-python sdist, so cellserve's benchmark
# can be run against a pinned reference server.
#
# Usage: bench/build_llamacpp.sh [PREFIX]
#   PREFIX defaults to $HOME/.cache/cellserve/llama.cpp
# Prints the path of PREFIX/bin/llama-server on stdout (and nothing else); all build
# output goes to stderr. Idempotent: an existing binary is reused.
# Environment: PYTHON (default python3) runs pip; JOBS (default nproc) sets parallelism.
set -euo pipefail

readonly LLAMA_CPP_PYTHON_VERSION="0.3.36"
readonly PREFIX="${1:-${HOME}/.cache/cellserve/llama.cpp}"
readonly PY="${PYTHON:-python3}"
readonly BIN="${PREFIX}/bin/llama-server"

log() { printf '[build_llamacpp] %s\n' "$*" >&2; }

if [[ -x "${BIN}" ]]; then
    log "already built: ${BIN}"
    printf '%s\n' "${BIN}"
    exit 0
fi

if ! command -v cmake >/dev/null 2>&1; then
    log "cmake not found; installing it with ${PY} -m pip"
    "${PY}" -m pip install --quiet cmake >&2
    CMAKE="$("${PY}" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')"
else
    CMAKE="$(command -v cmake)"
fi
readonly CMAKE

WORK="$(mktemp -d "${TMPDIR:-/tmp}/build_llamacpp.XXXXXX")"
readonly WORK
trap 'rm -rf "${WORK}"' EXIT

log "downloading llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION} sdist"
"${PY}" -m pip download --no-binary :all: --no-deps \
    "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}" -d "${WORK}/dl" >&2

shopt -s nullglob
sdists=("${WORK}"/dl/llama_cpp_python-"${LLAMA_CPP_PYTHON_VERSION}".tar.gz)
shopt -u nullglob
if [[ ${#sdists[@]} -ne 1 ]]; then
    log "expected one sdist in ${WORK}/dl, found: $(ls "${WORK}/dl")"
    exit 1
fi
readonly SDIST="${sdists[0]}"
SDIST_SHA256="$(sha256sum "${SDIST}" | cut -d' ' -f1)"
readonly SDIST_SHA256
log "sdist ${SDIST##*/} sha256 ${SDIST_SHA256}"

tar -xzf "${SDIST}" -C "${WORK}"
readonly SRC="${WORK}/llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"
if [[ ! -f "${SRC}/CMakeLists.txt" ]]; then
    log "no vendored llama.cpp at ${SRC}"
    exit 1
fi

# LLAMA_USE_PREBUILT_UI=OFF keeps the build offline (it would fetch the web UI from the
# Hugging Face hub); the server then runs without an embedded UI, which the API ignores.
# LLAMA_OPENSSL=OFF: the server only needs plain HTTP on localhost.
cmake_args=(
    -S "${SRC}"
    -B "${WORK}/build"
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_CUDA=OFF
    -DGGML_NATIVE=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
)
# Older vendored trees link libcurl unless told not to; newer ones deprecate the flag.
if grep -q 'option(LLAMA_CURL' "${SRC}/CMakeLists.txt"; then
    cmake_args+=(-DLLAMA_CURL=OFF)
fi

log "configuring: ${cmake_args[*]}"
"${CMAKE}" "${cmake_args[@]}" >&2

readonly JOBS="${JOBS:-$(nproc)}"
log "building target llama-server with ${JOBS} jobs"
start_s="${SECONDS}"
"${CMAKE}" --build "${WORK}/build" --config Release --target llama-server -j "${JOBS}" >&2
log "build took $((SECONDS - start_s)) s"

built="${WORK}/build/bin/llama-server"
if [[ ! -x "${built}" ]]; then
    log "build finished but ${built} is missing"
    exit 1
fi
if ldd "${built}" 2>/dev/null | grep -q 'not found'; then
    log "llama-server has unresolved shared libraries:"
    ldd "${built}" >&2
    exit 1
fi

mkdir -p "${PREFIX}/bin"
install -m 0755 "${built}" "${BIN}.tmp.$$"
mv -f "${BIN}.tmp.$$" "${BIN}"
{
    printf 'llama-cpp-python %s\n' "${LLAMA_CPP_PYTHON_VERSION}"
    printf 'sdist_sha256 %s\n' "${SDIST_SHA256}"
    printf 'cmake_args %s\n' "${cmake_args[*]:4}"
    printf 'built_at %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"${PREFIX}/BUILD_INFO"
log "installed ${BIN} (provenance in ${PREFIX}/BUILD_INFO)"
printf '%s\n' "${BIN}"
