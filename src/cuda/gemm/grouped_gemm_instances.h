// src/cuda/gemm/grouped_gemm_instances.h — the compiled bf16/f16 grouped GEMMs as a table that host
// code can query (grouped_gemm_instances.def, one line each), without including CUTLASS.
#pragma once

#include "cuda/gemm/grouped_gemm_kernels.h"
#include "gmoe/dtype.h"

namespace gmoe::cuda_backend {

/// One compiled configuration.
struct GemmInstance {
  DType in, out;
  GemmPass pass;
  GemmEpilogue epilogue;
  TileConfig tile;
};

/// Every compiled configuration, in the order of grouped_gemm_instances.def.
inline constexpr GemmInstance kGemmInstances[] = {
#define GMOE_GROUPED_GEMM(file, in, out, pass, epilogue, tile) \
  {DType::in, DType::out, GemmPass::pass, GemmEpilogue::epilogue, TileConfig::tile},
#include "cuda/gemm/grouped_gemm_instances.def"
#undef GMOE_GROUPED_GEMM
};

/// Whether this configuration is compiled.
constexpr bool compiled(DType in, DType out, GemmPass pass, GemmEpilogue epilogue, TileConfig tile) {
  for (const GemmInstance& k : kGemmInstances) {
    if (k.in == in && k.out == out && k.pass == pass && k.epilogue == epilogue && k.tile == tile) return true;
  }
  return false;
}

}  // namespace gmoe::cuda_backend
