# kvroute router image.
#
#   scripts/build-image                 # kvroute:VERSION, with docker or (no engine) buildah
#   docker build -t kvroute:0.1.0 .     # the same with docker by hand
#   docker run --rm -p 8000:8000 kvroute:0.1.0 --worker w0=http://vllm-0:8000
#
# Two stages: the builder turns the source tree into a wheel and installs it (with its
# dependencies and the epp and tracing extras) into a virtualenv; the final stage is python:3.11-slim plus that virtualenv,
# with no compiler, no pip (nor its cache) and no source tree. PYTHON_IMAGE swaps the base of
# both stages (scripts/build-image --base local: a Debian base for machines that reach no
# registry). .ci/image-check.sh builds the image and checks all this from inside it.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_PROGRESS_BAR=off \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Dependencies first, read from pyproject.toml: this layer is reused until the dependency
# list changes, so a code change only rebuilds the small wheel layer below. The `epp` and
# `tracing` extras come with them: the chart runs `kvroute epp` and exports traces from this
# image. xds-protos ships an old copy of opentelemetry-proto's modules, so the real one is
# installed last.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = p['optional-dependencies']; deps = p['dependencies'] + extras['epp'] + extras['tracing']; open('/tmp/requirements.txt', 'w').write(chr(10).join(deps) + chr(10))" \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install -r /tmp/requirements.txt \
 && /opt/venv/bin/pip install --force-reinstall --no-deps opentelemetry-proto
COPY . .
# The virtualenv's pip builds the wheel (a bare Debian python has no pip of its own) and is
# then removed with setuptools: installers are build-time tools (16 + 7 MB of the image).
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /dist . \
 && /opt/venv/bin/pip install --no-deps /dist/kvroute-*.whl \
 && /opt/venv/bin/pip uninstall --yes pip setuptools \
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
