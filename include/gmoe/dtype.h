// gmoe/dtype.h — element types gmoe knows about.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gmoe {

/// Element type of a tensor. Floating types follow their usual IEEE/OCP definitions:
/// e4m3 and e5m2 are the OCP FP8 formats (e4m3 "fn": no infinities), e8m0 is the MXFP8
/// exponent-only scale (value 2^(bits-127)).
enum class DType : uint8_t { f32, bf16, f16, e4m3, e5m2, e8m0, i32, i64 };

/// Size of one element in bytes.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::e4m3: return 1;
    case DType::e5m2: return 1;
    case DType::e8m0: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

/// Short lower-case name ("bf16", "f32", ...), as used in error messages and benchmark output.
const char* dtype_name(DType t);

/// Parses a name produced by dtype_name (also accepts "fp32", "fp16", "float32", "bfloat16",
/// "float16"); throws gmoe::Error naming the text otherwise.
DType dtype_from_name(const std::string& name);

/// True for f32, bf16, f16 (the dtypes the bf16/fp16 GEMM paths take as inputs or outputs).
constexpr bool is_float16_or_32(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16;
}

}  // namespace gmoe
