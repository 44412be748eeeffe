# vramwatch collector: FastAPI + uvicorn + SQLite. No torch in this image.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vramwatch ./vramwatch
COPY dashboard ./dashboard
RUN pip install --no-cache-dir build==1.2.2 && python -m build --wheel --outdir /dist

FROM python:3.11-slim
LABEL org.opencontainers.image.title="vramwatch collector" \
      org.opencontainers.image.description="Live GPU-memory telemetry for deep-learning training"
COPY --from=build /dist /dist
RUN pip install --no-cache-dir "$(ls /dist/vramwatch-*.whl)[server]" && rm -rf /dist \
    && useradd --system --uid 10001 --home-dir /data --create-home vramwatch
USER 10001
WORKDIR /data
ENV VRAMWATCH_DB=/data/vramwatch.db \
    PYTHONUNBUFFERED=1
VOLUME ["/data"]
EXPOSE 8765
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8765/healthz', timeout=4).status == 200 else 1)"]
# Set VRAMWATCH_TOKEN (or mount a --token-file) before exposing this beyond a private network.
ENTRYPOINT ["vramwatch"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8765"]
