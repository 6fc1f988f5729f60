# The image a Kubernetes TrainJob runs (bash launch_multi_gpu.sh --k8s --image IMAGE; docs/launcher.md,
# "Kubernetes"): this repository as the working directory, its requirements installed. From the repository's root:
#   docker build -t ghcr.io/you/multigpu-train:1.0 .
#   docker build --build-arg EXTRAS=hf,ft -t ghcr.io/you/multigpu-train:1.0 .    # with extras (pyproject.toml)
# then push it where the cluster pulls from. PyPI's torch wheels for Linux bring their own CUDA libraries: the
# cluster's nodes need only NVIDIA's driver and device plugin.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The TrainJob's command names its files relative to this folder (multigpu/launch/torchrun.py, main_multi_gpu.py).
WORKDIR /workspace/multigpu

# The requirements first, in a layer of their own: a change to the code does not reinstall torch.
COPY requirements.txt ./
RUN pip install -r requirements.txt

COPY . .
ARG EXTRAS=""
RUN if [ -n "$EXTRAS" ]; then pip install ".[$EXTRAS]"; fi
