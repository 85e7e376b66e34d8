# One image for every Strata service; compose.yaml picks the service with `strata serve <name>`.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# A C compiler for the native CPU kernels (kernels/native.py builds them for the CPU it runs on).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# CPU torch first (the CUDA wheels are several GB and unused by the CPU image).
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml constraints.txt README.md ./
COPY protos ./protos
COPY services ./services
COPY kernels ./kernels
RUN pip install --no-cache-dir -c constraints.txt -e . --config-settings editable_mode=compat \
 && python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
      $(find protos -name '*.proto') \
 && python -m kernels.native

# The model directory is mounted at /model (see compose.yaml); `strata model tiny --out /model`
# writes a tiny one when none is mounted.
ENTRYPOINT ["strata"]
