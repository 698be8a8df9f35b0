// tests/fuzz/fuzz_safetensors.cpp — libFuzzer target for the safetensors parser.
//
// Every input must either parse or throw gmoe::Error; anything else (a crash, an out-of-bounds read
// caught by AddressSanitizer, an overflow caught by UBSan, another exception type, a leak) is a
// finding. When the input parses, every byte of every tensor range is read, so a range the
// validator let past the end of the buffer shows up at once, and every tensor the parser accepts
// is viewed as a TensorView whose byte count must match its range. Build and run (cmake/fuzz.cmake does this in the tests):
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I include -I src \
//     tests/fuzz/fuzz_safetensors.cpp src/checkpoint/safetensors.cpp src/common/{dtype,tensor}.cpp
//   ./a.out -max_total_time=20 -max_len=1048576 -dict=tests/fuzz/safetensors.dict CORPUS_DIR tests/fuzz/corpus
#include <cstddef>
#include <cstdint>

#include <cstdlib>

#include "checkpoint/internal.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const gmoe::SafetensorsHeader h = gmoe::parse_safetensors(data, size, "fuzz-input");
    volatile uint8_t sink = 0;
    for (const gmoe::SafetensorsEntry& e : h.tensors) {
      const uint8_t* p = data + h.data_offset + e.begin;
      for (uint64_t i = 0; i < e.nbytes(); ++i) sink = sink ^ p[i];
      if (e.has_gmoe_dtype && e.shape.size() <= 6) {
        const gmoe::TensorView v = gmoe::ckpt_detail::make_view(p, e.dtype, e.shape);
        if (static_cast<uint64_t>(v.nbytes()) != e.nbytes() || v.numel() != e.numel()) std::abort();
      }
    }
    (void)h.find("x");
  } catch (const gmoe::Error&) {
    // Rejected with a message: the expected outcome for malformed input.
  }
  return 0;
}
