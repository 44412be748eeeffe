# syntax=docker/dockerfile:1
# vramwatch collector: FastAPI + uvicorn + SQLite. No torch in this image.
#   docker build -t <registry>/vramwatch:<version> . && docker push <registry>/vramwatch:<version>
# Reproducible: the base image is pinned by digest and every Python dependency by version and
# sha256 digest: deploy/build-requirements.txt and deploy/image-requirements.txt, installed with
# --require-hashes (regenerate: python deploy/server_constraints.py > deploy/server-constraints.txt,
# then python deploy/image_lock.py). No plotly Python package: the dashboard vendors plotly.js.
# The digest is python:3.11.13-slim-bookworm's as pinned by several public projects (this
# build environment cannot reach Docker Hub); check or refresh it with
#   docker buildx imagetools inspect python:3.11.13-slim-bookworm
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:86adf8dbadc3d6e82ee5dd2c74bec2e1c2467cdad47886280501df722372d2e1

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY deploy/build-requirements.txt /build-requirements.txt
COPY pyproject.toml README.md ./
COPY vramwatch ./vramwatch
COPY dashboard ./dashboard
# the build backend is hash-checked too (no unpinned isolated build env)
RUN pip install --no-cache-dir --require-hashes --no-deps -r /build-requirements.txt \
    && pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /dist .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="vramwatch collector" \
      org.opencontainers.image.description="Live GPU-memory telemetry for deep-learning training"
# uid and gid 10001, matching the k8s securityContext (a --system user would get a system gid)
RUN groupadd --gid 10001 vramwatch \
    && useradd --uid 10001 --gid 10001 --no-log-init --home-dir /data --create-home \
       --shell /usr/sbin/nologin vramwatch
COPY --from=build /dist /dist
COPY deploy/image-requirements.txt /requirements.txt
# server: the collector; otlp: `serve --otlp-endpoint` (the OpenTelemetry SDK and its OTLP/HTTP exporter):
# their every distribution from the hash-checked lock, then the wheel alone; pip check fails the
# build if the lock missed a dependency
RUN pip install --no-cache-dir --require-hashes --no-deps -r /requirements.txt \
    && pip install --no-cache-dir --no-deps --no-index "$(ls /dist/vramwatch-*.whl)[server,otlp]" \
    && pip check \
    && rm -rf /dist /requirements.txt
USER 10001:10001
WORKDIR /data
ENV VRAMWATCH_DB=/data/vramwatch.db \
    PYTHONUNBUFFERED=1
VOLUME ["/data"]
EXPOSE 8765
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8765/healthz', timeout=4).status == 200 else 1)"]
# Give the collector a token (VRAMWATCH_TOKEN or --token-file) before exposing it: it only warns without one.
ENTRYPOINT ["vramwatch"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8765"]
