# A CUDA image that serves MegaSlide: `docker run --gpus all -p 8000:8000 megaslide`; a worker
# of a shared store: `docker run --gpus all megaslide megaslide worker --database URL --storage DIR`.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first: on Linux x86_64 the registry's torch wheel is the CUDA build this image wants.
RUN pip install torch==2.11.0

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
CMD ["megaslide", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data", "--device", "cuda"]
