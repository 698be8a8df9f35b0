// tools/bench/cuda_runner.cu — gemm cases on the CUDA backend, timed with CUDA events, beside two
// baselines measured in the same run on the same GPU:
//   cublas_dense  one cuBLAS GEMM of the same total size (rows × K by K × N): the practical ceiling;
//   cublas_loop   one cuBLAS GEMM per non-empty expert with the counts on the host: what users
//                 run without a grouped GEMM.
// Inputs are rotated among several copies when one copy would sit in L2.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "bench/check.h"
#include "bench/cuda_util.h"
#include "bench/runner.h"
#include "gmoe/error.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/memory_pool.h"

#define BENCH_CUBLAS(call)                                                                     \
  do {                                                                                         \
    cublasStatus_t st_ = (call);                                                               \
    GMOE_CHECK(st_ == CUBLAS_STATUS_SUCCESS, #call " failed: ", cublasGetStatusString(st_));   \
  } while (0)

namespace gmoe::bench {
namespace {

cudaDataType_t cuda_type(DType dt) { return dt == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F; }

// Row-major GEMM helpers on cuBLAS (column-major): a row-major [r, c] matrix is its transpose.
// fprop  Y[M,N]  = X[M,K]·W[N,K]ᵀ  ->  Yᵀ = W·Xᵀ     : gemm(T, N, N, M, K, W, K, X, K, Y, N)
// dgrad  dX[M,K] = dY[M,N]·W[N,K]  ->  dXᵀ = Wᵀ·dYᵀ  : gemm(N, N, K, M, N, W, K, dY, N, dX, K)
// wgrad  dW[N,K] = dY[M,N]ᵀ·X[M,K] ->  dWᵀ = Xᵀ·dY   : gemm(N, T, K, N, M, X, K, dY, N, dW, K)
void cublas_pass(cublasHandle_t h, const std::string& pass, DType dt, int64_t M, int64_t N, int64_t K,
                 const void* a_rows, const void* w, void* out) {
  const float one = 1.f, zero = 0.f;
  const cudaDataType_t t = cuda_type(dt);
  if (M == 0) return;
  if (pass == "fprop") {
    BENCH_CUBLAS(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, t, K, a_rows, t, K, &zero, out, t, N,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else if (pass == "dgrad") {
    BENCH_CUBLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, &one, w, t, K, a_rows, t, N, &zero, out, t, K,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

void cublas_wgrad(cublasHandle_t h, DType dt, int64_t M, int64_t N, int64_t K, const void* dy, const void* x,
                  void* dw) {
  const float one = 1.f, zero = 0.f;
  const cudaDataType_t t = cuda_type(dt);
  BENCH_CUBLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, K, N, M, &one, x, t, K, dy, t, N, &zero, dw, t, K,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

bool cuda_available(std::string* name) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  if (name) *name = prop.name;
  return prop.major == 9;  // the kernels are sm_90a
}

void release_cached_memory_cuda() {
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev) == cudaSuccess ? cudaDeviceSynchronize() : cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("  gmoe-bench: cannot release gmoe's cached memory: %s\n", cudaGetErrorString(err));
    return;
  }
  trim_memory_pool(Device::cuda(dev));
}

std::vector<ResultRow> run_gemm_case_cuda(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  const BenchStream stream;

  const int64_t nx = c.rows * c.K, ndy = c.rows * c.N, nw = c.E * c.N * c.K;
  // Copies of the inputs to rotate through so that no timed run finds them in L2.
  const size_t set_bytes = (nx + ndy + nw) * es;
  const int sets = rotation_sets(set_bytes);
  std::vector<std::unique_ptr<DeviceBuffer>> xs, dys, ws;
  for (int s = 0; s < sets; ++s) {
    xs.push_back(std::make_unique<DeviceBuffer>(nx * es));
    dys.push_back(std::make_unique<DeviceBuffer>(ndy * es));
    ws.push_back(std::make_unique<DeviceBuffer>(nw * es));
    fill_uniform(xs[s]->ptr, dt, nx, o.seed + 10 * s);
    fill_uniform(dys[s]->ptr, dt, ndy, o.seed + 10 * s + 1);
    fill_uniform(ws[s]->ptr, dt, nw, o.seed + 10 * s + 2);
  }
  DeviceBuffer y(ndy * es), dx(nx * es), dw(nw * es), counts_d(c.E * sizeof(int32_t));
  std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
  BENCH_CUDA(cudaMemcpy(counts_d.ptr, counts.data(), c.E * sizeof(int32_t), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaStreamSynchronize(cudaStreamLegacy));  // a pageable upload may return before it lands
  const std::vector<int64_t> off = prefix_offsets(c.counts);

  // Host copies of set 0 for the sampled checks.
  std::vector<uint8_t> hx(nx * es), hdy(ndy * es), hw(nw * es), hout(std::max({nx, ndy, nw}) * es);
  BENCH_CUDA(cudaMemcpy(hx.data(), xs[0]->ptr, nx * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hdy.data(), dys[0]->ptr, ndy * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hw.data(), ws[0]->ptr, nw * es, cudaMemcpyDeviceToHost));
  const GemmHostData hd{dt, c.E, c.rows, c.N, c.K, off, hx.data(), hw.data(), hdy.data()};

  const Device gpu = Device::cuda(0);
  const TensorView cv(counts_d.ptr, DType::i32, gpu, {c.E});
  auto xv = [&](int s) { return TensorView(xs[s % sets]->ptr, dt, gpu, {c.rows, c.K}); };
  auto dyv = [&](int s) { return TensorView(dys[s % sets]->ptr, dt, gpu, {c.rows, c.N}); };
  auto wv = [&](int s) { return ExpertWeights::from_stacked(TensorView(ws[s % sets]->ptr, dt, gpu, {c.E, c.N, c.K})); };
  const TensorView yv(y.ptr, dt, gpu, {c.rows, c.N}), dxv(dx.ptr, dt, gpu, {c.rows, c.K});
  const ExpertWeights dwv = ExpertWeights::from_stacked(TensorView(dw.ptr, dt, gpu, {c.E, c.N, c.K}));

  cublasHandle_t h;
  BENCH_CUBLAS(cublasCreate(&h));
  BENCH_CUBLAS(cublasSetStream(h, stream));

  struct Pass {
    const char* name;
    DeviceBuffer* out;
    int64_t out_elems;
    std::function<void(int)> gmoe, dense, loop;
  };
  auto xp = [&](int s, int64_t row) { return static_cast<char*>(xs[s % sets]->ptr) + row * c.K * es; };
  auto dyp = [&](int s, int64_t row) { return static_cast<char*>(dys[s % sets]->ptr) + row * c.N * es; };
  auto wp = [&](int s, int64_t e) { return static_cast<char*>(ws[s % sets]->ptr) + e * c.N * c.K * es; };
  std::vector<Pass> passes = {
      {"fprop", &y, ndy,
       [&](int s) { grouped_gemm_fprop(xv(s), wv(s), cv, yv, stream); },
       [&](int s) { cublas_pass(h, "fprop", dt, c.rows, c.N, c.K, xp(s, 0), wp(s, 0), y.ptr); },
       [&](int s) {
         for (int64_t e = 0; e < c.E; ++e)
           cublas_pass(h, "fprop", dt, c.counts[e], c.N, c.K, xp(s, off[e]), wp(s, e),
                       static_cast<char*>(y.ptr) + off[e] * c.N * es);
       }},
      {"dgrad", &dx, nx,
       [&](int s) { grouped_gemm_dgrad(dyv(s), wv(s), cv, dxv, stream); },
       [&](int s) { cublas_pass(h, "dgrad", dt, c.rows, c.N, c.K, dyp(s, 0), wp(s, 0), dx.ptr); },
       [&](int s) {
         for (int64_t e = 0; e < c.E; ++e)
           cublas_pass(h, "dgrad", dt, c.counts[e], c.N, c.K, dyp(s, off[e]), wp(s, e),
                       static_cast<char*>(dx.ptr) + off[e] * c.K * es);
       }},
      {"wgrad", &dw, nw,
       [&](int s) { grouped_gemm_wgrad(dyv(s), xv(s), cv, dwv, {}, stream); },
       [&](int s) { cublas_wgrad(h, dt, c.rows, c.N, c.K, dyp(s, 0), xp(s, 0), dw.ptr); },
       [&](int s) {
         for (int64_t e = 0; e < c.E; ++e) {
           void* dwe = static_cast<char*>(dw.ptr) + e * c.N * c.K * es;
           if (c.counts[e] == 0) {
             BENCH_CUDA(cudaMemsetAsync(dwe, 0, c.N * c.K * es, stream));
           } else {
             cublas_wgrad(h, dt, c.counts[e], c.N, c.K, dyp(s, off[e]), xp(s, off[e]), dwe);
           }
         }
       }},
  };

  std::vector<ResultRow> rows;
  const double flops = gemm_flops(c);
  auto add = [&](const char* pass, const char* impl, double ms, std::optional<bool> ok, std::string note) {
    rows.push_back(timed_row(c.name, pass, impl, dtype_name(dt), ms, flops, ok, std::move(note)));
  };
  for (Pass& p : passes) {
    if (!o.runs_pass(p.name)) continue;
    // Correctness first: poisoned output (0xff bytes are NaN), one run, sampled fp64 check.
    BENCH_CUDA(cudaMemsetAsync(p.out->ptr, 0xff, p.out_elems * es, stream));
    p.gmoe(0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    check_device_errors(stream);
    BENCH_CUDA(cudaMemcpy(hout.data(), p.out->ptr, p.out_elems * es, cudaMemcpyDeviceToHost));
    const CheckResult chk = check_pass(hd, p.name, hout.data(), dt, o.samples, o.seed + 7);
    add(p.name, "gmoe", time_ms(p.gmoe, o.warmup, o.iters, stream, o.gemm_warm_ms), chk.ok, chk.detail);
    if (o.baselines) {
      add(p.name, "cublas_dense", time_ms(p.dense, o.warmup, o.iters, stream, o.gemm_warm_ms), std::nullopt, "");
      add(p.name, "cublas_loop", time_ms(p.loop, o.warmup, o.iters, stream, o.gemm_warm_ms), std::nullopt, "");
    }
  }
  cublasDestroy(h);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return rows;
}

}  // namespace gmoe::bench
