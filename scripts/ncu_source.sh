#!/usr/bin/env bash
# Device script (issue 4): per-instruction warp stall samples of one decode step (ncu SourceCounters), for
# analysis off the GPU with scripts/ncu_stalls.py.
#
#   bash scripts/ncu_source.sh llama-3.2-1b 512    (writes $OUT/ncu_MODEL_CTX.{ncu-rep,sass.csv.gz,details.csv})
#
# The megakernel is built with -lineinfo (its own cached build), one step profiled after a few warm-up steps.
# sass.csv.gz: one row per SASS instruction (address, text, warp stall samples by reason, executed counts), in
# address order; details.csv: the kernel-wide sections. (ncu's `--print-source cuda` lists the source without
# metrics for this kernel, so the per-instruction rows are what to aggregate; docs/PERF.md, twenty-fifth session.)
set -u
MODEL=${1:-llama-3.2-1b}; CTX=${2:-512}; OUT=${OUT:-.}
export AMK_NVCC_FLAGS="${AMK_NVCC_FLAGS:-} -lineinfo"
python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 1 >/dev/null   # build outside the profiler
ncu --kernel-name amk_megakernel --launch-skip 4 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --import-source yes -f -o "$OUT/ncu_${MODEL}_${CTX}" \
    python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 6 2>&1 | tail -3
ncu -i "$OUT/ncu_${MODEL}_${CTX}.ncu-rep" --page details --csv > "$OUT/ncu_${MODEL}_${CTX}.details.csv" 2>&1
ncu -i "$OUT/ncu_${MODEL}_${CTX}.ncu-rep" --page source --csv --print-source sass 2>&1 \
    | gzip > "$OUT/ncu_${MODEL}_${CTX}.sass.csv.gz"
ls -la "$OUT"
