#!/usr/bin/env bash
# Device script (issue 4): DRAM bytes read and L2 hits of one decode step per config (ncu metrics), to tell whether
# the L2 prefetches' bytes are read once (hits) or twice (evicted before use).
#
#   bash scripts/ncu_bytes.sh llama-3.2-1b 512 '{}' '{"mlp_prefetch_kb": 0}' ...
set -u
MODEL=$1; CTX=$2; shift 2
M=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_read_lookup_hit.sum,gpu__time_duration.sum
bash "$(dirname "$0")/ncu_step_metrics.sh" "$M" "$MODEL" "$CTX" "$@"
