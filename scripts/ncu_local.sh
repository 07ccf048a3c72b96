#!/usr/bin/env bash
# Device script (issue 4): how the megakernel's local-memory (stack) traffic fares in the L1 over one decode step.
#
#   bash scripts/ncu_local.sh MODEL CTX [CONFIG]     (AMK_NVCC_FLAGS picks the build, as elsewhere)
#
# Local memory holds the op context, the arguments of the noinline calls and the ABI's saved registers; if the
# weight streaming evicts those lines from the L1, every stack load after a wait is an L2 round trip. Prints the
# local and global load sectors with their L1 lookup hits / misses and the local / generic load instructions
# (the candidate metrics ncu knows on this GPU; others are skipped and named).
set -u
MODEL=${1:-llama-3.2-1b}; CTX=${2:-512}; CFG=${3:-"{}"}
WANT="l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_hit.sum
l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss.sum l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum
l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum l1tex__t_requests_pipe_lsu_mem_local_op_st.sum
l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit.sum
l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_miss.sum smsp__inst_executed_op_local_ld.sum
smsp__inst_executed_op_local_st.sum smsp__inst_executed_op_generic_ld.sum smsp__inst_executed_op_global_ld.sum
smsp__inst_executed_op_shared_ld.sum lts__t_sectors_srcunit_tex_aperture_device_op_read.sum
lts__t_sectors_srcunit_tex_op_read.sum"
KNOWN=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
M=""
for w in $WANT; do
  base=${w%.sum}
  if echo "$KNOWN" | grep -qx "$base"; then M="$M${M:+,}$w"; else echo "skip (unknown to ncu): $w"; fi
done
python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 1 --config "$CFG" >/dev/null   # build outside ncu
echo "== $MODEL ctx $CTX $CFG ${AMK_NVCC_FLAGS:-}"
ncu --kernel-name amk_megakernel --launch-skip 4 --launch-count 1 --metrics "$M" --csv \
    python scripts/profile_step.py "$MODEL" --ctx "$CTX" --steps 6 --config "$CFG" 2>&1 \
    | grep -E '"[a-z0-9]+__' | awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | tr -d '"'
