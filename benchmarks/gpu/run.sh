#!/usr/bin/env bash
# The GPU benchmark run: CUDA-only tests, then the GPU benchmarks, then a short table, in one call
# of about 8 minutes on an H200 (see docs/bench.md for what each part measures).
#
#   bash benchmarks/gpu/run.sh                         # on the GPU machine, from anywhere; results in $OUT
#   DEVICE=cpu QUICK=1 NOCOMPILE=1 bash benchmarks/gpu/run.sh   # dry run on a CPU: tiny shapes
#   PARTS=fp8 bash benchmarks/gpu/run.sh               # the fp8 benchmark instead (issue 15; its own call,
#                                                      # about 6 minutes): fp8 CUDA tests, large linears, the block
#
# Every part runs under its own time limit and inside one shared budget (BUDGET seconds, default
# 470). If the first part (env: python, torch, the device) fails, nothing else can run: the script
# stops at once with exit 1. A later part that fails or runs out of time is logged and the next one
# runs (one GPU run is precious: keep what can be had), and the script ends with a status line per
# part and exit 1 when any part failed, so a broken run is never read as a good one. Files in $OUT
# (8 at most come back from the device tool): run.log, bench_eager.json, overhead.json,
# overhead_ref.json, compile_main.json, masters_step.json, compile_more.json, summary.md.
# With PARTS=fp8: run.log, fp8_linear.json, fp8_block.json, summary.md.
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/mixprec-out/gpu}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-470}
QUICK=${QUICK:-0}
NOCOMPILE=${NOCOMPILE:-0}
PARTS=${PARTS:-main}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG=$OUT/run.log
: > "$LOG"
START=$(date +%s)
STATUS=()   # "name: ok|FAILED rc=N|TIME LIMIT|skipped" per part, in order
FAILED=0
if [ "$QUICK" = 1 ]; then
  SHAPE=tiny; SMALL=tiny; REPS=2; OREPS=3; MROUNDS=2; EXTRA="--threads 1"
  FP8_WIDTHS="64"; FP8_TOKENS=128; FP8_REPS=2
else
  SHAPE=ref; SMALL=small; REPS=20; OREPS=30; MROUNDS=20; EXTRA=""
  FP8_WIDTHS="4096 8192"; FP8_TOKENS=8192; FP8_REPS=10
fi
COMPILE=both
[ "$NOCOMPILE" = 1 ] && COMPILE=off
BENCH="$PY -m mixprec bench --device $DEVICE $EXTRA"

part() {  # part NAME LIMIT_S MIN_S COMMAND...: run COMMAND under min(LIMIT_S, budget left), unless < MIN_S is left
  local name=$1 limit=$2 min=$3
  shift 3
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt "$min" ]; then
    echo "--- $name: skipped, ${left}s of ${BUDGET}s left" | tee -a "$LOG"
    STATUS+=("$name: skipped (budget)")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  # @BUDGET@ in a command: the seconds the command itself may plan for (its limit less a margin
  # for start-up and writing results), so a bench stops in time instead of being killed
  local budget=$(( limit - 20 )) args=() a
  [ "$budget" -lt 10 ] && budget=10
  for a in "$@"; do args+=("${a//@BUDGET@/$budget}"); done
  set -- "${args[@]}"
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  local note=""
  [ "$rc" = 124 ] && note=" (time limit)"
  echo "--- $name: rc=$rc in $(( $(date +%s) - t0 ))s$note" | tee -a "$LOG"
  # pytest's 5 is "no tests collected": the CUDA tests on a CPU dry run
  if [ "$rc" = 0 ] || { [ "$rc" = 5 ] && [[ "$name" == *cuda-tests ]]; }; then
    STATUS+=("$name: ok")
  else
    FAILED=1
    if [ "$rc" = 124 ]; then STATUS+=("$name: TIME LIMIT"); else STATUS+=("$name: FAILED rc=$rc"); fi
    echo "!!! $name FAILED (rc=$rc): see $LOG" >&2
    tail -n 15 "$LOG" >&2
  fi
  return "$rc"
}

part env 30 5 bash -c "set -e; $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no CUDA\")'; $PY -c 'import mixprec; print(\"mixprec\", mixprec.__version__)'; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv 2>/dev/null || true" || {
  echo "!!! the environment is broken (python, torch or mixprec cannot start): nothing else can run; stopping" | tee -a "$LOG" >&2
  exit 1
}
if [ "$PARTS" = fp8 ]; then
  # fp8 against bf16-mixed: the matmul peaks (bf16 F.linear, fp8 _scaled_mm) and an MLP d -> 4d -> d
  # training step at 4096 and 8192 wide, eager and compiled; then the reference block (all four of
  # its linears in fp8), eager and compiled, with the e4m3 and bf16 peaks beside
  part fp8-cuda-tests 120 30 $PY -m pytest -m cuda -q -p no:cacheprovider -rs tests/fp8
  # shellcheck disable=SC2086
  part fp8-linear 200 60 $PY benchmarks/fp8_linear.py --device $DEVICE --widths $FP8_WIDTHS --tokens $FP8_TOKENS --reps $FP8_REPS --compile $COMPILE $EXTRA --budget-s @BUDGET@ --json "$OUT/fp8_linear.json"
  part fp8-block 200 60 $BENCH --shape $SHAPE --recipes bf16-mixed fp8-current fp8-delayed --compile $COMPILE --tf32 off --reps $REPS --steps-per-rep 3 --budget-s @BUDGET@ --json "$OUT/fp8_block.json" --markdown
else

# rc 5 = no CUDA tests collected
part cuda-tests 150 30 $PY -m pytest -m cuda -q -p no:cacheprovider -rs
part eager 120 40 $BENCH --shape $SHAPE --reps $REPS --steps-per-rep 3 --tf32 both --budget-s @BUDGET@ --json "$OUT/bench_eager.json" --markdown
# where the step's host overhead shows (a small, launch-bound shape), then the reference shape
part overhead 90 30 $BENCH --overhead --shape $SMALL --recipes fp32 bf16-mixed fp16-mixed --optimizer fused foreach --reps $OREPS --plain --json "$OUT/overhead.json" --markdown
part overhead-ref 60 25 $BENCH --overhead --shape $SHAPE --recipes bf16-mixed fp16-mixed --optimizer fused foreach --reps $(( OREPS * 2 / 3 )) --json "$OUT/overhead_ref.json" --markdown
# the storage recipes' own step work on 150 small weight tensors (launch-bound on a GPU): what batching buys there
part masters-step 45 15 $PY benchmarks/masters_step.py --device $DEVICE --rounds $MROUNDS --json "$OUT/masters_step.json"
if [ "$NOCOMPILE" != 1 ]; then
  # the goal pair first (bf16-mixed against fp32, TF32 off), then every recipe (the cache makes repeats cheap)
  part compile-main 200 90 $BENCH --shape $SHAPE --compile on --tf32 off --recipes fp32 bf16-mixed --reps $REPS --steps-per-rep 3 --budget-s @BUDGET@ --json "$OUT/compile_main.json" --markdown
  # every recipe compiled cold takes longer than this part has: --budget-s keeps what fits
  part compile-more 150 60 $BENCH --shape $SHAPE --compile on --tf32 both --reps $REPS --steps-per-rep 3 --budget-s @BUDGET@ --json "$OUT/compile_more.json" --markdown
fi
fi  # PARTS
echo "total $(( $(date +%s) - START ))s of ${BUDGET}s" | tee -a "$LOG"
timeout -k 5 30 $PY benchmarks/gpu/summary.py "$OUT" || { FAILED=1; STATUS+=("summary: FAILED"); }
echo "== parts" | tee -a "$LOG"
for s in "${STATUS[@]}"; do echo "  $s" | tee -a "$LOG"; done
if [ "$FAILED" != 0 ]; then
  echo "!!! at least one part failed: the numbers above are incomplete (exit 1)" | tee -a "$LOG" >&2
  exit 1
fi
