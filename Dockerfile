# trainbench on the official PyTorch CUDA runtime image (Docker Hub pytorch/pytorch).
# The image's torch satisfies the project's torch==2.13.0 pin, so pip installs only the other dependencies.
#   docker build -t trainbench:latest .
#   enroot import dockerd://trainbench:latest        # -> trainbench+latest.sqsh, for pyxis (--container-image)
ARG BASE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE}

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /opt/trainbench
COPY pyproject.toml README.md ./
COPY src ./src
# [cudnn]: cuDNN's fused attention for packed BERT rows (model.packed_attention=auto takes it on the GPU)
RUN python -m pip install '.[cudnn]' && python -m trainbench list

# Data and results live on mounts: --container-mounts=/lustre/data:/data,/lustre/results:/results
WORKDIR /results
ENTRYPOINT ["python", "-m", "trainbench"]
CMD ["--help"]
