#!/usr/bin/env bash
# Device script (issue 4): instruction-fetch counters of one decode step per config (ncu metrics): requests to the
# SM instruction cache (ICC) and their misses, the GPC-level cache's instruction requests and misses, and the
# share of warp cycles stalled with no instruction -- whether the megakernel's ~600 KB of SASS misses its caches.
#
#   bash scripts/ncu_icache.sh llama-3.2-1b 512 '{}' ...    (AMK_NVCC_FLAGS picks the build, as elsewhere)
#
# The metric names are checked against `ncu --query-metrics` first; names this ncu / GPU lacks are dropped.
set -u
MODEL=$1; CTX=$2; shift 2
WANT="sm__icc_requests.sum sm__icc_requests_lookup_hit.sum sm__icc_requests_lookup_miss.sum
gcc__cache_requests_type_instruction.sum gcc__cache_requests_type_instruction_lookup_miss.sum
smsp__inst_executed.sum smsp__warp_issue_stalled_no_instruction_per_warp_active.pct
smsp__warps_issue_stalled_no_instruction.sum smsp__cycles_active.sum gpu__time_duration.sum"
AVAIL=$(ncu --query-metrics 2>/dev/null | awk '{print $1}')
M=""
for m in $WANT; do
  base=${m%.*}
  if echo "$AVAIL" | grep -qx -e "$base" -e "${base%_per_warp_active}"; then M="$M,$m"; else echo "(ncu lacks $base)"; fi
done
M=${M#,}
echo "metrics: $M"
bash "$(dirname "$0")/ncu_step_metrics.sh" "$M" "$MODEL" "$CTX" "$@"
