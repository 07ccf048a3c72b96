// Shared by the standalone microbenchmarks (scripts/ring_micro.cu, scripts/mem_micro.cu): the error check, the
// shared-space address of a pointer, and the best-of-N CUDA-event timing of one launch.
#pragma once
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

// In main() only: print the failing call and return 1.
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__device__ __forceinline__ uint32_t saddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// launch() once to warm up, then the fastest of `reps` timed launches, in ms.
template <class F>
float micro_best_ms(F launch, int reps = 5) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  launch();
  cudaDeviceSynchronize();
  float best = 1e9f;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    best = ms < best ? ms : best;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}
