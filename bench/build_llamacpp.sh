#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize (CPU only, Release, static llama/ggml
# libs) from the llama.cpp source vendored in the llama-cpp-python sdist, so cellserve's
# benchmark can be run against a pinned reference server; its converter
# (convert_hf_to_gguf.py with conversion/ and gguf-py/) is kept under PREFIX/convert for
# bench/make_8b.py, which makes the 8B-shaped benchmark model with it.
#
# Usage: [LLAMA_ISA=native|avx2|avx512|avx512_bf16] bench/build_llamacpp.sh [PREFIX]
#   LLAMA_ISA (default native) picks the instruction set ggml is compiled for, named as
#   cellserve's CELLSERVE_ISA levels (model/kernels/isa.py) so that both run the same one:
#     native       -DGGML_NATIVE=ON (whatever this CPU has)
#     avx2         AVX2+FMA+F16C+BMI2, no AVX-512 (x86-64-v3)
#     avx512       + AVX-512 F/BW/VL/DQ/CD, no VNNI/BF16 (x86-64-v4)
#     avx512_bf16  + AVX-512 VNNI and BF16, no AMX
#   PREFIX defaults to $HOME/.cache/cellserve/llama.cpp (native) or
#   $HOME/.cache/cellserve/llama.cpp-$LLAMA_ISA, so each ISA keeps its own binary.
# Prints the path of PREFIX/bin/llama-server on stdout (and nothing else); all build
# output goes to stderr. Idempotent: an existing build (both binaries and the converter)
# is reused.
# Environment: PYTHON (default python3) runs pip; JOBS (default nproc) sets parallelism.
set -euo pipefail

readonly LLAMA_CPP_PYTHON_VERSION="0.3.36"
readonly ISA="${LLAMA_ISA:-native}"
case "${ISA}" in
    native) isa_args=(-DGGML_NATIVE=ON) ; default_prefix="${HOME}/.cache/cellserve/llama.cpp" ;;
    avx2)
        isa_args=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
            -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
            -DGGML_AMX_BF16=OFF)
        default_prefix="${HOME}/.cache/cellserve/llama.cpp-avx2" ;;
    avx512 | avx512_bf16)
        isa_args=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF
            -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
        if [[ "${ISA}" == avx512_bf16 ]]; then
            isa_args+=(-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
        else
            isa_args+=(-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
        fi
        default_prefix="${HOME}/.cache/cellserve/llama.cpp-${ISA}" ;;
    *) printf '[build_llamacpp] LLAMA_ISA must be native, avx2, avx512 or avx512_bf16, not %s\n' "${ISA}" >&2
       exit 2 ;;
esac
readonly PREFIX="${1:-${default_prefix}}"
readonly PY="${PYTHON:-python3}"
readonly BIN="${PREFIX}/bin/llama-server"
readonly QUANTIZE="${PREFIX}/bin/llama-quantize"
readonly CONVERT="${PREFIX}/convert/convert_hf_to_gguf.py"

log() { printf '[build_llamacpp] %s\n' "$*" >&2; }

if [[ -x "${BIN}" && -x "${QUANTIZE}" && -f "${CONVERT}" ]]; then
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
    "${isa_args[@]}"
    -DGGML_CPU_ALL_VARIANTS=OFF
    -DGGML_BACKEND_DL=OFF
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
log "building targets llama-server llama-quantize with ${JOBS} jobs"
start_s="${SECONDS}"
"${CMAKE}" --build "${WORK}/build" --config Release --target llama-server llama-quantize \
    -j "${JOBS}" >&2
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
install -m 0755 "${WORK}/build/bin/llama-quantize" "${QUANTIZE}.tmp.$$"
mv -f "${QUANTIZE}.tmp.$$" "${QUANTIZE}"
rm -rf "${PREFIX}/convert"
mkdir -p "${PREFIX}/convert"
cp -r "${SRC}/convert_hf_to_gguf.py" "${SRC}/conversion" "${SRC}/gguf-py" "${PREFIX}/convert/"
install -m 0755 "${built}" "${BIN}.tmp.$$"
mv -f "${BIN}.tmp.$$" "${BIN}"
{
    printf 'llama-cpp-python %s\n' "${LLAMA_CPP_PYTHON_VERSION}"
    printf 'isa %s\n' "${ISA}"
    printf 'sdist_sha256 %s\n' "${SDIST_SHA256}"
    printf 'cmake_args %s\n' "${cmake_args[*]:4}"
    printf 'built_at %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"${PREFIX}/BUILD_INFO"
log "installed ${BIN} (provenance in ${PREFIX}/BUILD_INFO)"
printf '%s\n' "${BIN}"
