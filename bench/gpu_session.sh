#!/usr/bin/env bash
# What a session with a lent GPU runs, in stages that each fit one device call (10 minutes).
#
# Here, first: `make gpu-kit` (the ComfyUI trees and the wheels the offline GPU image lacks).
# Then the device tool: carry [".comfyui", ".gpu_kit"], command `bench/gpu_session.sh STAGE`:
#   tests-unit    tests/unit with its CUDA-only tests
#   tests-server  the server tests on CUDA (not the browser's): layerwise with and without LoRA,
#                 phases, from disk, quantized, Model-Level Swap, tiers, interrupt
#                 (TESTS_SERVER=... names other test files)
#   bench-engine  bench/layerwise.py (LAYERWISE_ARGS adds options)
#   bench-comfy   bench/comfy_wan.py: core full / core partial / layerwise (COMFY_WAN_ARGS adds
#                 options, e.g. "--visible-gb 8"; it writes an ~11 GB model first)
# ComfyUI 0.33 with Dynamic VRAM (carry [".gpu_kit"] alone: the 0.33 tree travels inside it):
#   tests-033     the Dynamic VRAM server tests of the 0.33 lane on CUDA, where core runs Dynamic
#                 VRAM (TESTS_033=tests for the whole lane, if it fits a call)
#   bench-dynamic bench/comfy_wan.py --dynamic: core's Dynamic VRAM alone, the node's auto and
#                 engine modes at the same visible VRAM (DYNAMIC_ARGS adds options)
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
case ${1:-} in tests-033|bench-dynamic) KIT_WHEELS=".gpu_kit/wheels/*.whl .gpu_kit/comfyui-033/*.whl" ;;
                *) KIT_WHEELS=".gpu_kit/wheels/*.whl" ;; esac
# shellcheck disable=SC2086  # a word list of globs
for wheel in $KIT_WHEELS; do "$PY" -m zipfile -e "$wheel" "$SITE" || exit 1; done
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
case ${1:-} in tests-033|bench-dynamic)
  # The 0.33 tree, unpacked outside the checkout; the harness runs its server with this Python.
  TREE=${TMPDIR:-/tmp}/tiered_offload_comfyui_033
  rm -rf "$TREE" && mkdir -p "$TREE" && tar -xzf .gpu_kit/comfyui-033/comfyui-0.33.tar.gz -C "$TREE" \
    || { echo "!! no ComfyUI 0.33 tree in the kit (make gpu-kit)"; exit 1; }
  export TIERED_OFFLOAD_COMFY_ROOT=$TREE/ComfyUI TIERED_OFFLOAD_COMFY_PYTHON=$PY
  "$PY" -c "import comfy_aimdo.control, comfy_kitchen" || { echo "!! the 0.33 kit does not import"; exit 1; }
  ;;
esac
"$PY" -c "import comfyui_frontend_package, torchsde, av" || { echo "!! the GPU kit does not import"; exit 1; }

{
  "$PY" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__,
    "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

rc=0
# Every stage ends inside one 10-minute device call with its log written as it goes: the
# command is interrupted after STAGE_SECONDS (pytest then tears its servers down and prints its
# summary), and a test is stopped after TEST_SECONDS (pytest-timeout, in the
# image), so a hang costs one test, not the call and everything it measured.
STAGE_SECONDS=${STAGE_SECONDS:-540}
PYTEST_TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT=(--timeout "${TEST_SECONDS:-240}")
run() {  # run NAME CMD...: log to $OUT/NAME.log, keep going, remember a failure
  local name=$1; shift
  echo "== $name: $*"
  timeout -s INT -k 30 "$STAGE_SECONDS" "$@" > "$OUT/$name.log" 2>&1 || { rc=1; echo "!! $name failed"; }
  tail -n 25 "$OUT/$name.log"
}

case ${1:-} in
  tests-unit)
    export OMP_NUM_THREADS=2
    run tests-unit "$PY" -m pytest tests/unit -q -rs -p no:cacheprovider "${PYTEST_TIMEOUT[@]}"
    ;;
  tests-server)
    export OMP_NUM_THREADS=2
    # shellcheck disable=SC2086  # a word list of paths
    run tests-server "$PY" -m pytest ${TESTS_SERVER:-tests/test_e2e_tiny_models.py \
      tests/test_layerwise_nodes.py tests/test_layerwise_mode.py tests/test_phase_families.py \
      tests/test_disk_streaming.py tests/test_quantized_models.py tests/test_model_swap.py \
      tests/test_tiers_server.py tests/test_kept_pack.py tests/test_block_budget.py \
      tests/test_timeline_routes.py} -q -rs -p no:cacheprovider "${PYTEST_TIMEOUT[@]}"
    ;;
  bench-engine)
    # shellcheck disable=SC2086  # a word list of options
    run layerwise "$PY" bench/layerwise.py ${LAYERWISE_ARGS:-} --out "$OUT/layerwise.json"
    ;;
  bench-comfy)
    # shellcheck disable=SC2086  # a word list of options
    run comfy_wan "$PY" bench/comfy_wan.py ${COMFY_WAN_ARGS:-} --out "$OUT/comfy_wan.json"
    ;;
  tests-033)
    export OMP_NUM_THREADS=2
    # The Dynamic VRAM tests by default (one call is 10 minutes); TESTS_033=tests runs the lane.
    # shellcheck disable=SC2086  # a word list of paths
    run tests-033 "$PY" -m pytest -m comfy_tree ${TESTS_033:-tests/test_dynamic_vram_gpu.py \
      tests/test_layerwise_mode.py tests/test_dynamic_vram_compat.py tests/test_loaded_models.py} \
      -q -rs -p no:cacheprovider "${PYTEST_TIMEOUT[@]}" --ignore=tests/unit --ignore=tests/test_panel.py
    ;;
  bench-dynamic)
    # shellcheck disable=SC2086  # a word list of options
    run comfy_wan_dynamic "$PY" bench/comfy_wan.py --dynamic ${DYNAMIC_ARGS:-} \
      --out "$OUT/comfy_wan_dynamic.json"
    ;;
  *)
    echo "usage: $0 tests-unit|tests-server|bench-engine|bench-comfy|tests-033|bench-dynamic" >&2
    exit 2
    ;;
esac
exit $rc
