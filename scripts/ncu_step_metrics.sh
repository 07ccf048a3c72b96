#!/usr/bin/env bash
# Device script (issue 4): ncu metrics of one decode step of the megakernel per config -- the loop that
# scripts/ncu_bytes.sh (DRAM / L2 bytes) and scripts/ncu_icache.sh (instruction fetch) share.
#
#   bash scripts/ncu_step_metrics.sh METRICS MODEL CTX CONFIG...   (METRICS: ncu's comma-separated list)
#
# Each config is built outside the profiler first (AMK_NVCC_FLAGS picks the build, as elsewhere); the step profiled
# is the fifth launch, after four warm-up steps. Prints "metric unit value" per line.
set -u
M=$1; MODEL=$2; CTX=$3; shift 3
for CFG in "$@"; do
  python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 1 --config "$CFG" >/dev/null
  echo "== $CFG ${AMK_NVCC_FLAGS:-}"
  ncu --kernel-name amk_megakernel --launch-skip 4 --launch-count 1 --metrics "$M" --csv \
      python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 6 --config "$CFG" 2>/dev/null \
      | grep -E '"[a-z0-9]+__' | awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | tr -d '"'
done
