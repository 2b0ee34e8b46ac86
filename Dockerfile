# syntax=docker/dockerfile:1.7
# kubemoe's container images, one target each (the Helm chart's default image values name them):
#
#   docker build --target operator      -t ghcr.io/kubemoe/operator:0.1.0 .
#   docker build --target frontend      -t ghcr.io/kubemoe/frontend:0.1.0 .        # CUDA (torch wheels from PyPI)
#   docker build --target expert-fn     -t ghcr.io/kubemoe/expert-fn:0.1.0 .       # CUDA
#   docker build --target frontend-cpu  -t ghcr.io/kubemoe/frontend:0.1.0-cpu .    # CPU-only torch, much smaller
#   docker build --target expert-fn-cpu -t ghcr.io/kubemoe/expert-fn:0.1.0-cpu .
#
# Every image runs as the non-root user 65532 (the operator renders pods with runAsUser 65532 and a
# read-only root filesystem; /tmp is an emptyDir). No weights are baked in: checkpoints come from
# the MoEDeployment's spec.model.uri.

ARG PYTHON_VERSION=3.11

# -- the kubemoe wheel, built once from the source tree --------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubemoe/ kubemoe/
COPY proto/ proto/
COPY expert_fn/ expert_fn/
COPY frontend/ frontend/
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /wheels .

# -- operator: Kopf and the Kubernetes client only, no torch ---------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS operator
RUN groupadd --gid 65532 kubemoe && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp kubemoe
COPY --from=wheel /wheels /wheels
# The operator imports kubemoe.operator, kubemoe.bundles, kubemoe.proto and the routing-table module:
# install the wheel without its serving dependencies (torch, transformers) and add what those need.
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
 && pip install --no-cache-dir "kopf>=1.37" "kubernetes>=37" "click>=8.1" "protobuf>=7.35.1,<8" "pyyaml>=6" \
 && rm -rf /wheels
USER 65532:65532
ENV HOME=/tmp PYTHONUNBUFFERED=1
ENTRYPOINT ["python", "-m", "kubemoe.operator.cli"]

# -- serving images: GPU (PyPI's torch, which brings the CUDA libraries it needs) -------------------------
# Not an nvidia/cuda base: their Ubuntu's python3 is older than kubemoe's requires-python. The node's
# driver comes in through the NVIDIA container toolkit, for the GPUs the device plugin allocated;
# the toolkit mounts its compute libraries only where the image asks for them, as below.
FROM python:${PYTHON_VERSION}-slim AS serving-gpu
RUN groupadd --gid 65532 kubemoe && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp kubemoe
ENV HOME=/tmp PYTHONUNBUFFERED=1 NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels

# -- serving images: CPU (torch from the CPU wheel index) ------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS serving-cpu
RUN groupadd --gid 65532 kubemoe && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp kubemoe
ENV HOME=/tmp PYTHONUNBUFFERED=1
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch>=2.4" \
 && pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels

# The frontend and the expert function are the same install; the target fixes the default command
# (the operator passes the subcommand's flags as args).
FROM serving-gpu AS frontend
USER 65532:65532
EXPOSE 8000 50051
ENTRYPOINT ["kubemoe"]
CMD ["frontend", "--help"]

FROM serving-gpu AS expert-fn
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kubemoe"]
CMD ["expert-fn", "--help"]

FROM serving-cpu AS frontend-cpu
USER 65532:65532
EXPOSE 8000 50051
ENTRYPOINT ["kubemoe"]
CMD ["frontend", "--help"]

FROM serving-cpu AS expert-fn-cpu
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kubemoe"]
CMD ["expert-fn", "--help"]
