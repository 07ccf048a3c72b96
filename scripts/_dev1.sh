#!/bin/bash
export AMK_CACHE_DIR=/tmp/amkc PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 330 python -m pytest -q tests/vm/test_attention_gpu.py tests/vm/test_megakernel_gpu.py tests/test_cli.py -k "long or fp32_cache or bf16 or f16 or cli" 2>&1 | tail -4
echo "tests took $(( $(date +%s) - t0 )) s"
timeout 130 python scripts/ab_builds.py llama-3.2-1b --ctx 512 --rounds 5 --variants 'mma={}' 'fma={"nvcc":"-DAMK_ATTN_MMA=0"}' 2>&1 | sed -n '/^==/,$p'
timeout 120 python scripts/ab_builds.py llama-3.2-1b --ctx 8192 --rounds 3 --variants 'mma={}' 'fma={"nvcc":"-DAMK_ATTN_MMA=0"}' 2>&1 | sed -n '/^==/,$p'
echo "total $(( $(date +%s) - t0 )) s"
