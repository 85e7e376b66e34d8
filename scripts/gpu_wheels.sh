#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a lent GPU machine beyond its image, fetched here into .whl/
# (ignored by git) for the device tool to carry: the lent machine has Python 3.12 with torch, Triton,
# transformers 5.17, tokenizers, safetensors, numpy, PyYAML, psutil, pytest... but no registry.
#
#   bash scripts/gpu_wheels.sh            # everything: the tests, the step benchmark, the control plane
#   bash scripts/gpu_wheels.sh --tests    # only what the test phases and the step benchmark import
#
# Then the device tool's run carries [".whl", "strata"] (strata/ is the generated protobuf code,
# also ignored) and runs `bash scripts/gpu_check.sh`, which installs .whl/*.whl into /tmp/site.
# Versions are this project's pins (constraints.txt), as CPython 3.12 manylinux x86-64 wheels.
# The tree, strata/ and .whl/ travel together, 64 MiB at most: this script fails above LIMIT_MIB.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
DEST=.whl
LIMIT_MIB=${LIMIT_MIB:-56}

# The test phases (tests/sched_harness.py imports the generated protos, grpc and the etcd client) and
# the transformers the tests compare against, at the pinned version (the image has 5.17).
TESTS=(grpcio protobuf grpcio-health-checking grpcio-reflection googleapis-common-protos aetcd transformers
       typing_extensions)
# The control plane: every service's imports (tracing, grammars, the HTTP front) and the bench client.
STACK=(opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
       opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common
       opentelemetry-exporter-otlp-proto-grpc opentelemetry-instrumentation opentelemetry-instrumentation-grpc
       xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection annotated-doc
       fastapi starlette uvicorn h11 anyio sniffio idna httpx2 httpcore2 truststore openai jiter
       prometheus_client)

names=("${TESTS[@]}")
[[ ${1:-} == --tests ]] || names+=("${STACK[@]}")

pins=()
for name in "${names[@]}"; do
  # constraints.txt spells names as pip freeze does ('-' or '_'); match either.
  pattern=$(sed 's/[-_]/[-_]/g' <<<"$name")
  pin=$(grep -iE "^${pattern}==" constraints.txt | head -1 || true)
  [[ -n $pin ]] || { echo "gpu_wheels: $name has no pin in constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${pins[@]}"

# etcd for the control plane's stack (Debian's etcd-server, `make system-deps`): a static Go binary.
if [[ ${1:-} != --tests ]]; then
  etcd=$(command -v etcd || true)
  [[ -n $etcd ]] || { echo "gpu_wheels: no etcd here (make system-deps installs it)" >&2; exit 1; }
  "$PY" -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.compress(open(sys.argv[1], "rb").read()))' \
    "$etcd" "$DEST/etcd.xz"
fi

count=$(ls "$DEST"/*.whl | wc -l)
[[ $count -eq ${#pins[@]} ]] || { echo "gpu_wheels: $count wheels for ${#pins[@]} pins" >&2; exit 1; }
ls -l "$DEST" | awk 'NR > 1 {printf "%8.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -cb "$DEST"/* | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
awk -v w="$total" -v t="$tree" -v d="$DEST" 'BEGIN { printf "gpu_wheels: %.1f MiB in %s/, with the tracked tree %.1f MiB (a call carries 64 MiB at most)\n", w / 1048576, d, (w + t) / 1048576 }'
(( total <= LIMIT_MIB * 1048576 )) || { echo "gpu_wheels: over ${LIMIT_MIB} MiB" >&2; exit 1; }
