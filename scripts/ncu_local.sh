#!/usr/bin/env bash
# Device script (issue 4): how the megakernel's local-memory (stack) traffic fares in the L1 over one decode step.
#
#   bash scripts/ncu_local.sh llama-3.2-1b 512 '{}' ...     (AMK_NVCC_FLAGS picks the build, as elsewhere)
#
# Local memory holds the op context, the arguments of the noinline calls and the ABI's saved registers; if the
# weight streaming evicted those lines from the L1, every stack load after a wait would be an L2 round trip
# (thirty-first session: 99.8% hits). Prints the local and global load sectors with their L1 lookup hits / misses
# and the load instructions by space, via scripts/ncu_step_metrics.sh; of the candidate metrics only those this
# ncu knows on the GPU are asked for (the others are named and skipped).
set -u
MODEL=$1; CTX=$2; shift 2
WANT="l1tex__t_sectors_pipe_lsu_mem_local_op_ld l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_hit
l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss l1tex__t_requests_pipe_lsu_mem_local_op_ld
l1tex__t_sectors_pipe_lsu_mem_local_op_st l1tex__t_requests_pipe_lsu_mem_local_op_st
l1tex__t_sectors_pipe_lsu_mem_global_op_ld l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit
l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_miss smsp__inst_executed_op_local_ld
smsp__inst_executed_op_local_st smsp__inst_executed_op_generic_ld smsp__inst_executed_op_global_ld
smsp__inst_executed_op_shared_ld"
KNOWN=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
M=""
for w in $WANT; do
  if echo "$KNOWN" | grep -qx "$w"; then M="$M${M:+,}$w.sum"; else echo "skip (unknown to ncu): $w"; fi
done
bash "$(dirname "$0")/ncu_step_metrics.sh" "$M" "$MODEL" "$CTX" "${@:-{\}}"
