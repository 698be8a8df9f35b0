// src/common/dtype.cpp — dtype names.
#include "gmoe/dtype.h"

#include "gmoe/error.h"

namespace gmoe {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
    case DType::e8m0: return "e8m0";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  struct Alias { const char* text; DType type; };
  static const Alias kAliases[] = {
      {"f32", DType::f32},   {"fp32", DType::f32},  {"float32", DType::f32},
      {"bf16", DType::bf16}, {"bfloat16", DType::bf16},
      {"f16", DType::f16},   {"fp16", DType::f16},  {"float16", DType::f16},
      {"e4m3", DType::e4m3}, {"e5m2", DType::e5m2}, {"e8m0", DType::e8m0},
      {"i32", DType::i32},   {"int32", DType::i32}, {"i64", DType::i64}, {"int64", DType::i64},
  };
  for (const Alias& a : kAliases) {
    if (name == a.text) return a.type;
  }
  GMOE_FAIL("unknown dtype name '", name, "'");
}

}  // namespace gmoe
