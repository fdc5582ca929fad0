# One image for every slora service: control plane, gateway, workers, migrations, demo assets.
#   docker compose --profile cpu up     (see docker-compose.yml)
# torch comes from the package index pip is configured with; pass
# --build-arg PIP_EXTRA_INDEX_URL=<index of CPU-only torch wheels> for a smaller CPU image.
FROM python:3.11-slim

ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}

WORKDIR /app
# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN pip install "torch>=2.4" "grpcio-tools>=1.62" "psycopg[binary]>=3.1"
COPY proto ./proto
COPY slora ./slora
COPY slora_core ./slora_core
COPY kernels ./kernels
COPY services ./services
COPY migrations ./migrations
COPY alembic.ini ./
# Generated protobuf code is a build product (DESIGN section 2).
RUN python -m services.codegen && pip install -e .

RUN useradd --create-home slora && mkdir -p /data && chown slora /data
USER slora
EXPOSE 50051 50061 50071 9100
CMD ["slora", "--help"]
