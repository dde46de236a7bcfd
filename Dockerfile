# MegaSlide's server: `docker build -t megaslide .` then `docker run --gpus all -p 8000:8000
# megaslide`; a worker of a shared store: `docker run --gpus all megaslide megaslide worker
# --database URL --storage DIR`.
#
# Without CUDA (a CPU image, built and run anywhere):
#   docker build -t megaslide-cpu --build-arg BASE_IMAGE=ubuntu:24.04 \
#       --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> .
#
# TORCH_VERSION is the one the README installs (tests/test_layout.py keeps them equal, and within
# pyproject.toml's range).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
# Empty: the package registry's default torch wheel (on Linux x86_64, a CUDA build).
ARG TORCH_INDEX_URL=

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, so that installing the project never resolves another build of it.
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY server server
COPY clients clients
RUN pip install ".[all]" ./clients/python

ENV MEGASLIDE_DATA_DIR=/data
VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
# The device is chosen at start: CUDA when the container sees a GPU, else the CPU.
CMD ["megaslide", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
