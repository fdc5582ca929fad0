# One image for every slora service: control plane, migrations, gateway, workers, demo assets.
#   docker build -t slora:latest .                            CPU target (the default)
#   docker build -t slora:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       --build-arg TRITON_VERSION= .                         GPU target
# Pinned: torch 2.13.0, the CPU build from PyTorch's CPU index, with triton 3.9.0 (the pair the
# test suite runs with). The GPU target takes torch 2.13.0 from a CUDA index of PyTorch's (cu128
# above; pick one your driver supports) and the triton version that build pins itself
# (TRITON_VERSION empty); it is not built by the tests here (no GPU). Everything else:
# deploy/requirements-image.txt, the versions the test suite ran with (regenerate it with
# deploy/pin_image_deps.py).
FROM python:3.11-slim

# Triton compiles small C launchers when it first runs a kernel: it needs a C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# Dependencies first, so code changes do not reinstall torch.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TRITON_VERSION=3.9.0
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
COPY deploy/requirements-image.txt /tmp/requirements-image.txt
RUN pip install -r /tmp/requirements-image.txt ${TRITON_VERSION:+"triton==$TRITON_VERSION"} \
 && rm /tmp/requirements-image.txt

# The package itself, non-editable: the build compiles proto/ into slora/v1 and the wheel
# carries the migrations (migrations/, mapped into the services package by setup.py), so the
# sources are not kept in the image.
COPY . /tmp/src
RUN pip install --no-deps --no-build-isolation /tmp/src \
 && rm -rf /tmp/src \
 && pip check

RUN useradd --create-home --uid 10001 slora && mkdir -p /data && chown slora /data
USER slora
WORKDIR /home/slora
EXPOSE 50051 50061 50071 8080 9100
CMD ["slora", "--help"]
