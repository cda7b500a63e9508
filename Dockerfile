# syntax=docker/dockerfile:1
# inferd: one Dockerfile, two images (the CPU build of torch, or CUDA).
#
#   CPU:  docker build -t ghcr.io/inferd/inferd:0.1.0 .
#   CUDA: docker build -t ghcr.io/inferd/inferd:0.1.0-cuda \
#           --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#           --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
#   docker run -p 8000:8000 -v inferd-cache:/cache ghcr.io/inferd/inferd:0.1.0            # inferd serve
#   docker run -p 9000:9000 -v ./gateway.yaml:/etc/inferd/gateway.yaml \
#     -e INFERD_HEALTH_URL=http://127.0.0.1:9000/health ghcr.io/inferd/inferd:0.1.0 \
#     gateway --config /etc/inferd/gateway.yaml --host 0.0.0.0                            # inferd gateway
#
# The model cache (Hugging Face downloads, the compiled CPU attention kernel) is the volume /cache; the
# process runs as uid 1000 and needs no other writable path than /cache and /tmp, so a read-only root
# filesystem works (`inferd deploy k8s` renders it that way). `--gpu` there selects the `-cuda` tag.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

# python3 and venv where the base lacks them (the CUDA images); g++ builds the native CPU kernel at first use
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ $(command -v python3 >/dev/null || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/inferd \
 && /opt/inferd/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY inferd ./inferd
RUN /opt/inferd/bin/pip install --no-cache-dir . && rm -rf /src

RUN useradd --uid 1000 --user-group --create-home --home-dir /home/inferd inferd \
 && mkdir -p /cache && chown 1000:1000 /cache
ENV PATH=/opt/inferd/bin:$PATH \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    PYTHONUNBUFFERED=1 \
    INFERD_HEALTH_URL=http://127.0.0.1:8000/health
VOLUME ["/cache"]
WORKDIR /home/inferd
USER 1000:1000
EXPOSE 8000

# a replica answers 200 on /health once its model is loaded (503 while loading or draining)
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen(os.environ['INFERD_HEALTH_URL'], timeout=4).status != 200)"]

ENTRYPOINT ["inferd"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
