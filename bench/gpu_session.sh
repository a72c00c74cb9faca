#!/usr/bin/env bash
# What a session with a lent GPU runs, in stages that each fit one device call (10 minutes).
#
# Here, first: `make gpu-kit` (the ComfyUI tree and the wheels the offline GPU image lacks).
# Then the device tool: carry [".comfyui", ".gpu_kit"], command `bench/gpu_session.sh STAGE`:
#   tests   tests/unit with its CUDA-only tests, then every server test on CUDA (not the panel)
#   bench-engine  bench/layerwise.py (LAYERWISE_ARGS adds options)
#   bench-comfy   bench/comfy_wan.py: core full / core partial / layerwise (COMFY_WAN_ARGS adds
#                 options, e.g. "--visible-gb 8"; it writes an ~11 GB model first)
# Results and logs go to $OUT, which the device tool brings back (bench/results/gpu elsewhere).
# Commit the JSON under bench/results/; each file names the device it ran on.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

# The kit's wheels are all pure Python: unpacking them onto PYTHONPATH needs no pip and leaves
# the image's own packages (its CUDA torch above all) untouched. Outside the checkout, so a
# rehearsal here never makes the carried tree bigger.
SITE=${TMPDIR:-/tmp}/tiered_offload_gpu_kit
rm -rf "$SITE"
for wheel in .gpu_kit/wheels/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE" || exit 1; done
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import comfyui_frontend_package, torchsde, av" || { echo "!! the GPU kit does not import"; exit 1; }

{
  "$PY" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__,
    "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

rc=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, keep going, remember a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1 || { rc=1; echo "!! $name failed"; }
  tail -n 25 "$OUT/$name.log"
}

case ${1:-} in
  tests)
    export OMP_NUM_THREADS=2
    run tests-unit "$PY" -m pytest tests/unit -q -rs -p no:cacheprovider
    run tests-server "$PY" -m pytest tests -q -rs -p no:cacheprovider --ignore=tests/unit \
      --ignore=tests/test_panel.py
    ;;
  bench-engine)
    # shellcheck disable=SC2086  # a word list of options
    run layerwise "$PY" bench/layerwise.py ${LAYERWISE_ARGS:-} --out "$OUT/layerwise.json"
    ;;
  bench-comfy)
    # shellcheck disable=SC2086  # a word list of options
    run comfy_wan "$PY" bench/comfy_wan.py ${COMFY_WAN_ARGS:-} --out "$OUT/comfy_wan.json"
    ;;
  *)
    echo "usage: $0 tests|bench-engine|bench-comfy" >&2
    exit 2
    ;;
esac
exit $rc
