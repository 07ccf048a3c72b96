#!/usr/bin/env bash
# Device script (issue 4): DRAM bytes read and L2 hits of one decode step per config (ncu metrics), to tell whether
# the L2 prefetches' bytes are read once (hits) or twice (evicted before use).
#
#   bash scripts/ncu_bytes.sh llama-3.2-1b 512 '{}' '{"mlp_prefetch_kb": 0}' ...
set -u
MODEL=$1; CTX=$2; shift 2
M=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_read_lookup_hit.sum,gpu__time_duration.sum
for CFG in "$@"; do
  python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 1 --config "$CFG" >/dev/null
  echo "== $CFG"
  ncu --kernel-name amk_megakernel --launch-skip 4 --launch-count 1 --metrics $M --csv \
      python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 6 --config "$CFG" 2>/dev/null \
      | grep -E '"(dram|lts|gpu)__' | awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | tr -d '"'
done
