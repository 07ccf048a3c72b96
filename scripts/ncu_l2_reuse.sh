#!/usr/bin/env bash
# Device script (issue 4): where the read phase of scripts/l2_reuse_micro.cu finds its bytes (ncu, one launch per
# mode): DRAM bytes, the SMs' L2 read sectors (tex) that hit in the SM's own L2 partition, and the requests that
# crossed the L2 fabric to the other partition (and hit there). Tells dropped prefetches from far-partition hits.
#
#   bash scripts/ncu_l2_reuse.sh ["mode name" ...]   (default: the "only fetched rows" modes)
set -u
nvcc -O3 -std=c++17 -arch=sm_90a scripts/l2_reuse_micro.cu -o /tmp/l2_reuse || exit 1
M=dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_ltcfabric_lookup_hit.sum
if [ $# -eq 0 ]; then
  set -- "only fetched rows: cold" "only fetched rows: bulk pf" "only fetched rows: line pf" \
         "only fetched rows: ld" "only fetched rows: bulk copy"
fi
for mode in "$@"; do
  echo "== $mode"
  ncu --kernel-name k_tile --launch-count 1 --metrics $M --csv /tmp/l2_reuse "$mode" 2>&1 \
      | grep -E '"(dram|lts)__|ERR|rror' | awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | tr -d '"'
done
