# syntax=docker/dockerfile:1
# kvroute router image.
#
#   docker build -t kvroute:0.1.0 .
#   docker run --rm -p 8000:8000 kvroute:0.1.0 --worker w0=http://vllm-0:8000
#
# Two stages: the builder turns the source tree into a wheel and installs it (with its
# dependencies) into a virtualenv; the final stage is python:3.11-slim plus that virtualenv,
# with no compiler, no pip cache and no source tree. tests/deploy/test_image.py runs the
# same wheel -> venv -> `kvroute serve` steps without a Docker engine.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Dependencies first, read from pyproject.toml: this layer is reused until the dependency
# list changes, so a code change only rebuilds the small wheel layer below.
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; open('/tmp/requirements.txt', 'w').write(chr(10).join(deps) + chr(10))" \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install -r /tmp/requirements.txt
COPY . .
RUN python -m pip wheel --no-deps --wheel-dir /dist . \
 && /opt/venv/bin/pip install --no-deps /dist/kvroute-*.whl \
 && /opt/venv/bin/kvroute --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvroute" \
      org.opencontainers.image.description="KV-cache-aware, OpenAI-compatible load balancer for vLLM fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed, non-root UID: the Helm chart's securityContext (runAsUser 10001) matches it.
RUN groupadd --system --gid 10001 kvroute \
 && useradd --system --uid 10001 --gid kvroute --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvroute
COPY --from=builder /opt/venv /opt/venv
# KVROUTE_HOST: inside a container the router must listen on all interfaces (the default,
# 127.0.0.1, is unreachable from outside the container). --host still overrides it.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVROUTE_HOST=0.0.0.0
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvroute", "serve"]
