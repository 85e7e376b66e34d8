#!/usr/bin/env bash
# The GPU check of issue #32 (benchmarks/gpu_check.py), in one call of the device tool's `run`:
#
#   bash scripts/gpu_wheels.sh                          # here first, once: fills .whl/
#   run(command="bash scripts/gpu_check.sh --rev <commit>", carry=[".whl", "strata"], timeout_s=600)
#
# On the lent machine (Python 3.12 with torch and Triton, no registry, no virtualenv): installs the
# carried wheels into /tmp/site, unpacks the carried etcd, puts the repository on PYTHONPATH (nothing
# is installed there), and runs the check; gpu.json and gpu_check.log land in $OUT, which comes back.
# Anywhere else (no $OUT, no GPU) it is the CPU dry run, writing under .runs/gpu-check/: `make gpu-check`.
# Arguments go to benchmarks/gpu_check.py (--only PHASES, --budget-s, --rev ...).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

if [[ -z ${PY:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
out=${OUT:-$root/.runs/gpu-check}
mkdir -p "$out"

# $OUT is set on the lent machine only: there, the carried wheels replace or add to the image's.
if [[ -n ${OUT:-} ]] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -f .whl/etcd.xz ]] && ! command -v etcd >/dev/null; then
  mkdir -p /tmp/strata-bin
  "$PY" -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.decompress(open(sys.argv[1], "rb").read()))' \
    .whl/etcd.xz /tmp/strata-bin/etcd
  chmod +x /tmp/strata-bin/etcd
  export PATH=/tmp/strata-bin:$PATH
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  mode=(--device cuda)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
else
  mode=(--dry-run)
  echo "gpu_check: torch sees no GPU here: the CPU dry run" >&2
fi
exec "$PY" -m benchmarks.gpu_check "${mode[@]}" --out "$out/gpu.json" --log "$out/gpu_check.log" \
  --work /tmp/gpu-check "$@"
