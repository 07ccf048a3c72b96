// Device diagnostic (issue 4): which SMs share a GPC.
//
//   nvcc -O2 -std=c++17 -arch=sm_90a scripts/gpc_probe.cu -o /tmp/gpc_probe && /tmp/gpc_probe [out.json]
//
// A thread-block cluster is always scheduled inside one GPC, so the SMs that the blocks of one cluster run on
// belong to one GPC. The probe launches clusters of 2, 4, 8 and 16 blocks (one block per SM: the dynamic shared
// memory leaves room for one), each block records its %smid and stays resident ~20 us so that one launch covers
// every GPC, and the SMs of every cluster are joined (union-find). The components are the GPCs, as far as the
// launches reached: a GPC too small for a cluster size is joined by the smaller sizes. Prints, per cluster size,
// how many clusters fit at once (cudaOccupancyMaxActiveClusters), then the components with their SM ids; writes the
// components as JSON ({"gpcs": [[smid, ...], ...], "max_active_clusters": {...}}) where a path is given.
// Used with scripts/trace_raw.py (whose records carry each block's %smid) to ask whether the blocks that stream
// slowest in every step share a GPC.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

__global__ void probe(int* out) {
  if (threadIdx.x == 0) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    out[blockIdx.x] = (int)s;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {  // stay resident: the launch's clusters then occupy every GPC at once
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < 20000ull);
  }
}

static int find(std::vector<int>& p, int a) {
  while (p[a] != a) a = p[a] = p[p[a]];
  return a;
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int n_sm = prop.multiProcessorCount;
  const size_t smem = prop.sharedMemPerBlockOptin / 2 + 1024;  // more than half: one block per SM
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  int* d_out;
  CHECK(cudaMalloc(&d_out, sizeof(int) * 4096));
  std::vector<int> parent(4096);
  for (int i = 0; i < 4096; ++i) parent[i] = i;
  std::vector<bool> seen(4096, false);
  printf("%s, %d SMs\n", prop.name, n_sm);
  char mac[256] = "";
  for (int C : {16, 8, 4, 2}) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3(C);
    int nclu = 0;
    if (cudaOccupancyMaxActiveClusters(&nclu, probe, &cfg) != cudaSuccess || nclu <= 0) {
      cudaGetLastError();
      printf("cluster size %2d: does not fit\n", C);
      continue;
    }
    printf("cluster size %2d: %d clusters at once (%d SMs)\n", C, nclu, nclu * C);
    snprintf(mac + strlen(mac), sizeof(mac) - strlen(mac), "%s\"%d\": %d", mac[0] ? ", " : "", C, nclu);
    for (int rep = 0; rep < 40; ++rep) {
      const int grid = nclu * C;
      cfg.gridDim = dim3(grid);
      CHECK(cudaLaunchKernelEx(&cfg, probe, d_out));
      CHECK(cudaDeviceSynchronize());
      std::vector<int> h(grid);
      CHECK(cudaMemcpy(h.data(), d_out, sizeof(int) * grid, cudaMemcpyDeviceToHost));
      for (int b = 0; b < grid; ++b) {
        seen[h[b]] = true;
        const int a = find(parent, h[b]), r = find(parent, h[b - b % C]);
        if (a != r) parent[a] = r;
      }
    }
  }
  std::vector<std::vector<int>> comps;
  std::vector<int> root_of(4096, -1);
  for (int s = 0; s < 4096; ++s) {
    if (!seen[s]) continue;
    const int r = find(parent, s);
    if (root_of[r] < 0) {
      root_of[r] = (int)comps.size();
      comps.push_back({});
    }
    comps[root_of[r]].push_back(s);
  }
  std::sort(comps.begin(), comps.end(), [](const auto& a, const auto& b) { return a[0] < b[0]; });
  int covered = 0;
  for (auto& c : comps) covered += (int)c.size();
  printf("%zu components over %d SMs seen:\n", comps.size(), covered);
  for (auto& c : comps) {
    printf("  %2zu SMs:", c.size());
    for (int s : c) printf(" %d", s);
    printf("\n");
  }
  if (argc > 1) {
    FILE* f = fopen(argv[1], "w");
    if (!f) {
      fprintf(stderr, "cannot write %s\n", argv[1]);
      return 1;
    }
    fprintf(f, "{\"device\": \"%s\", \"sm_count\": %d, \"max_active_clusters\": {%s}, \"gpcs\": [", prop.name, n_sm, mac);
    for (size_t i = 0; i < comps.size(); ++i) {
      fprintf(f, "%s[", i ? ", " : "");
      for (size_t j = 0; j < comps[i].size(); ++j) fprintf(f, "%s%d", j ? ", " : "", comps[i][j]);
      fprintf(f, "]");
    }
    fprintf(f, "]}\n");
    fclose(f);
  }
  return 0;
}
