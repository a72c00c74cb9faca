#!/usr/bin/env bash
# One command of the GPU run; docs/gpu-session.md says how to call it, what
# it carries (.gpu_kit, from tools/gpu_kit.sh) and what comes back.
#
#   bench/gpu_session.sh first   [--rehearse]  ComfyUI 0.3.75: the CUDA unit tests, the server
#                                              tests that prove the results against core's full
#                                              load, the engine bench (P1-P3, P11, P12), the
#                                              ComfyUI bench against core's partial load (P4, P5)
#   bench/gpu_session.sh dynamic [--rehearse]  ComfyUI 0.33 with Dynamic VRAM: its CUDA tests,
#                                              then core's Dynamic VRAM against auto and engine (P4d)
#
# The parts run in priority order, each under its cap (the plan below, part:seconds). A part at
# its cap is interrupted (pytest then tears its servers down and prints its summary), killed
# GRACE seconds later, and every process it left behind (ComfyUI servers start sessions of their
# own) is killed with its process group. Everything is written as it happens: each part's log,
# and one JSON row per part, test and measurement in rows.jsonl; the finish part bundles the
# rest into extra.tar.gz and writes summary.json (bench/gpu_summary.py), whose table is printed
# last. At most 7 files come back from $OUT (the limit is 8).
#
# --rehearse runs the same parts with the same caps on this machine's CPU (its .venv and
# .venv-033, the benches at smoke sizes), in tests/artifacts/gpu_session/MODE unless OUT is set,
# and also checks what a call from this checkout would carry (bench/gpu_carry.py).
set -uo pipefail

# The plan: each mode's parts, part:cap in seconds. The caps add up to at most the mode's wall
# time on the device, unpacking the kit and the summary included: 8 minutes for first, 4 for
# dynamic (tests/unit/test_gpu_session_plan.py keeps that true).
PLAN_first="kit:30 unit:80 server:150 engine:95 comfy:110 finish:15"
PLAN_dynamic="kit:30 tests:105 p4d:90 finish:15"
GRACE=10  # seconds a part interrupted at its cap has to end before it is killed

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF=$REPO/bench/gpu_session.sh
cd "$REPO"

# ------------------------------------------------------------------ the parts
# Each runs in a process of its own (this script with --part), with the environment set below.

part_kit() {
  [ -d .gpu_kit/wheels ] || { echo "!! no .gpu_kit here: build it with tools/gpu_kit.sh and carry it"; return 1; }
  local wheels=(.gpu_kit/wheels/*.whl) tree=.gpu_kit/comfyui-0.3.75.tar.gz
  if [ "$MODE" = dynamic ]; then
    wheels+=(.gpu_kit/comfyui-033/*.whl)
    tree=.gpu_kit/comfyui-033/comfyui-0.33.tar.gz
  fi
  "$PY" bench/gpu_carry.py unpack --site "$SITE" "${wheels[@]}" || return 1
  mkdir -p "$(dirname "$COMFY_ROOT")" && tar -xzf "$tree" -C "$(dirname "$COMFY_ROOT")" || return 1
  local needed=(comfyui_frontend_package torchsde trampoline av)
  [ "$MODE" = dynamic ] && needed+=(comfy_aimdo comfy_kitchen sqlalchemy pydantic)
  "$COMFY_PY" -c 'import importlib.util as u, sys; gone = [m for m in sys.argv[1:] if u.find_spec(m) is None]
sys.exit(f"!! the kit lacks {gone}" if gone else 0)' "${needed[@]}" || return 1
  "$PY" bench/gpu_summary.py device --rows "$ROWS" --comfy-root "$COMFY_ROOT"
}

# The server tests that prove correctness on CUDA against core's full load, cheapest first:
# streaming (resident and streamed blocks), a LoRA and its strength change, a LoRA on resident
# blocks, a merge that fails, fp8 with a LoRA, the timeline's recorded run, a LoRA from disk, and
# --highvram (a server of its own). No interrupt, soak, compile or CPU-probe tests.
SERVER_TESTS=(
  tests/test_layerwise_nodes.py::test_offload_is_bit_identical_across_settings
  tests/test_layerwise_nodes.py::test_lora_is_honoured_and_strength_change_repacks_nothing
  tests/test_layerwise_nodes.py::test_lora_on_resident_blocks_is_merged_once_on_a_fresh_load
  tests/test_layerwise_nodes.py::test_a_merge_that_fails_fails_the_prompt_and_gives_the_model_back
  tests/test_layerwise_nodes.py::test_fp8_checkpoints_with_lora_stream_like_cores_full_load
  tests/test_timeline_routes.py::test_a_lease_records_one_pass_of_every_streamed_unit
  tests/test_disk_streaming.py::test_lora_from_disk_is_bit_identical_and_reads_the_models_file_in_place
  tests/test_layerwise_nodes.py::test_highvram_keeps_the_master_on_the_host
)

run_pytest() {  # run_pytest PER_TEST_TIMEOUT ARGS...: pytest with the session's rows and limits
  local per_test=$1; shift
  local timeout_args=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout_args=(--timeout "$per_test")
  else
    echo "!! no pytest-timeout: a test that hangs costs the whole part"
  fi
  OMP_NUM_THREADS=2 PYTHONPATH=$REPO/bench:$PYTHONPATH "$PY" -m pytest -q -rs -p no:cacheprovider \
    -p pytest_session_rows --basetemp "$WORK/pytest-$PART" "${timeout_args[@]}" "$@"
}

# The unit tests with a CUDA path (the engine's streams, events and copies; page-locking), not the
# whole folder: the rest runs the engine on the CPU, as CI does, and took the cap from these.
UNIT_TESTS=(tests/unit/test_gpu_streaming.py tests/unit/test_pinned.py)
part_unit() { run_pytest 45 "${UNIT_TESTS[@]}"; }
part_server() { run_pytest 100 --maxfail 3 "${SERVER_TESTS[@]}"; }
# Dynamic VRAM on CUDA: its own tests alone; the rest of the 0.33 lane runs classic models
# (tests/comfy_server.py) or CPU stand-ins, which the first call and CI already cover.
part_tests() { run_pytest 90 --maxfail 3 tests/test_dynamic_vram_gpu.py; }

part_engine() {
  local size=(--models wan,flux --wan-blocks 8 --flux-double 4 --flux-single 8)
  [ "$REHEARSE" = 1 ] && size=(--smoke)
  # auto last: a cut at the cap keeps the manual settings it is held against
  "$PY" bench/layerwise.py "${size[@]}" --settings 0:1,0:2,2:2,auto --lora-settings 2:2 --lora-rank 32 \
    --steps 3 --skip-naive --rows "$ROWS" --out "$WORK/results/layerwise.json"
}

part_comfy() {
  # One 6-block Wan-14B-dimension file (4.3 GiB), written once, for both workloads: Wan 480p video
  # (P5, compute-bound) and one 1024x1024 frame, Flux-dev's 4096 tokens (P4, bound by the copy).
  local size=(--layers 6 --visible-gb 5 --workloads wan-480p=832x480x33,flux-1024px=1024x1024x1)
  [ "$REHEARSE" = 1 ] && size=(--smoke --workloads wan-480p=64x64x5,flux-1024px=64x64x1)
  "$PY" bench/comfy_wan.py "${size[@]}" --steps 3 --repeats 2 --base "$WORK/comfy_base" \
    --rows "$ROWS" --out "$WORK/results/comfy_wan.json"
}

part_p4d() {
  local size=(--layers 4 --visible-gb 3 --workloads wan-480p=832x480x17)
  [ "$REHEARSE" = 1 ] && size=(--smoke --workloads wan-480p=64x64x5)
  "$PY" bench/comfy_wan.py --dynamic "${size[@]}" --steps 3 --repeats 2 --base "$WORK/comfy_base" \
    --rows "$ROWS" --out "$WORK/results/comfy_wan_dynamic.json"
}

part_finish() {
  # Everything else that should come back, in one file: the benches' JSON, the ComfyUI servers'
  # logs, what the tests wrote under tests/artifacts during this call.
  find tests/artifacts -path "${OUT#"$REPO"/}" -prune -o -type f -newer "$WORK/started" -print0 \
    2>/dev/null | xargs -0r cp --parents -t "$WORK"
  (cd "$WORK" && find results tests -type f 2>/dev/null; find . -name 'comfy-*.log' -type f) \
    > "$WORK/extra.list"
  tar -czf "$OUT/extra.tar.gz" -C "$WORK" -T "$WORK/extra.list" 2>&1 | tail -3
  # A log over the 16 MiB a file may bring back keeps its last 15 MiB.
  for log in "$OUT"/*.log; do
    [ -f "$log" ] && [ "$(stat -c %s "$log")" -gt $((16 << 20)) ] || continue
    tail -c $((15 << 20)) "$log" > "$log.tmp" && mv "$log.tmp" "$log"
  done
  local carry=()
  [ "$REHEARSE" = 1 ] && carry=(--rehearse --carry .gpu_kit)
  "$PY" bench/gpu_summary.py write --rows "$ROWS" --out "$OUT" --mode "$MODE" --plan "$PLAN" "${carry[@]}"
}

# ------------------------------------------------------------------ one part, in its process
if [ "${1:-}" = --part ]; then
  PART=$2
  trap 'exit 130' INT  # cut at the cap: end once the command in hand has ended
  "part_$PART"
  exit $?
fi

# ------------------------------------------------------------------ the session
MODE=${1:-}
REHEARSE=0
[ "${2:-}" = --rehearse ] && REHEARSE=1
case $MODE in first|dynamic) ;; *) echo "usage: $0 first|dynamic [--rehearse]" >&2; exit 2 ;; esac
plan_of=PLAN_$MODE
PLAN=${!plan_of}

if [ "$REHEARSE" = 1 ]; then
  PY=${PYTHON:-$REPO/.venv/bin/python}
  COMFY_PY=$PY
  [ "$MODE" = dynamic ] && COMFY_PY=${PYTHON_033:-$REPO/.venv-033/bin/python}
  if [ -z "${OUT:-}" ]; then
    OUT=$REPO/tests/artifacts/gpu_session/$MODE
    rm -rf "$OUT"
  fi
else
  PY=${PYTHON:-python3}
  COMFY_PY=$PY
  OUT=${OUT:?"OUT: an empty folder for what the command writes"}
fi
mkdir -p "$OUT"
[ -z "$(ls -A "$OUT")" ] || { echo "OUT=$OUT is not empty" >&2; exit 2; }
SESSION=$MODE-$$-$(date +%s)
# Outside the checkout, so that nothing unpacked or written here ever travels with a call.
WORK=${TMPDIR:-/tmp}/tiered_gpu_session_$MODE
rm -rf "$WORK" && mkdir -p "$WORK/results" && touch "$WORK/started"
SITE=$WORK/site
ROWS=$OUT/rows.jsonl
if [ "$MODE" = dynamic ]; then COMFY_ROOT=$WORK/comfyui-0.33/ComfyUI; else COMFY_ROOT=$WORK/comfyui-0.3.75/ComfyUI; fi
export MODE REHEARSE PLAN PY COMFY_PY OUT WORK SITE ROWS COMFY_ROOT
export PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export TIERED_OFFLOAD_COMFY_ROOT=$COMFY_ROOT TIERED_OFFLOAD_COMFY_PYTHON=$COMFY_PY
export TIERED_GPU_SESSION_ROWS=$ROWS

exec > >(tee -a "$OUT/session.log") 2>&1
TEE=$!

pgid_of() {  # the process group of a process, from /proc (the field after state and parent)
  cut -d')' -f2 "/proc/$1/stat" 2>/dev/null | awk '{print $3}'
}

end_left_processes() {  # end_left_processes MARKER: kill every process group the part left behind
  local marker=$1 own env pid pgid
  own=$(pgid_of $$)
  for env in $(grep -lzxF "TIERED_GPU_SESSION_PART=$marker" /proc/[0-9]*/environ 2>/dev/null); do
    pid=${env#/proc/}; pid=${pid%/environ}
    pgid=$(pgid_of "$pid")
    if [ -n "$pgid" ] && [ "$pgid" != "$own" ] && kill -KILL -- "-$pgid" 2>/dev/null; then
      echo "   killed process group $pgid (pid $pid) that the part left running"
    fi
  done
}

part_log() {  # where a part's output goes: the session log, or a log of its own
  case $1 in kit|finish) echo "" ;; engine|comfy|p4d) echo "$OUT/bench.log" ;; *) echo "$OUT/$1.log" ;; esac
}

echo "== bench/gpu_session.sh $MODE$([ "$REHEARSE" = 1 ] && echo " --rehearse"): $(date -u +%FT%TZ), plan: $PLAN"
failed=0
for item in $PLAN; do
  name=${item%%:*} cap=${item##*:}
  log=$(part_log "$name")
  echo "== $name (cap $cap s)$([ -n "$log" ] && echo ": $log")"
  start=$(date +%s%N)
  if [ -n "$log" ]; then
    echo "== $name $(date -u +%T)" >> "$log"
    TIERED_GPU_SESSION_PART=$SESSION:$name TIERED_GPU_SESSION_PART_NAME=$name \
      timeout -s INT -k "$GRACE" $((cap - GRACE)) "$BASH" "$SELF" --part "$name" >> "$log" 2>&1
  else
    TIERED_GPU_SESSION_PART=$SESSION:$name TIERED_GPU_SESSION_PART_NAME=$name \
      timeout -s INT -k "$GRACE" $((cap - GRACE)) "$BASH" "$SELF" --part "$name"
  fi
  rc=$?
  end_left_processes "$SESSION:$name"
  seconds=$(awk "BEGIN { printf \"%.1f\", ($(date +%s%N) - $start) / 1e9 }")
  case $rc in
    0) status=ok ;;
    124|137) status="cut at cap" ;;
    *) status="failed (rc $rc)" ;;
  esac
  [ "$rc" = 0 ] || failed=1
  [ -n "$log" ] && tail -n 6 "$log" | sed 's/^/   /'
  echo "== $name: $status in $seconds s"
  [ "$name" = finish ] || printf '{"row": "part", "part": "%s", "status": "%s", "rc": %d, "seconds": %s, "cap_s": %d}\n' \
    "$name" "$status" "$rc" "$seconds" "$cap" >> "$ROWS"
  if [ "$name" = kit ] && [ "$rc" != 0 ]; then
    echo "!! without the kit nothing else can run"
    "$BASH" "$SELF" --part finish
    break
  fi
done
exec >&- 2>&-
wait "$TEE"  # the session log complete before the call returns
exit $failed
