// tests/fuzz/fuzz_safetensors.cpp — libFuzzer target for the safetensors parser.
//
// Every input must either parse or throw gmoe::Error; anything else (a crash, an out-of-bounds read
// caught by AddressSanitizer, another exception type, a leak) is a finding. When the input parses,
// every byte of every tensor range is read, so a range the validator let past the end of the
// buffer shows up at once. Build and run (cmake/fuzz.cmake does this in the tests):
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I include -I src \
//     tests/fuzz/fuzz_safetensors.cpp src/checkpoint/*.cpp src/common/{dtype,tensor,grouped,cuda_unavailable}.cpp
//   ./a.out -max_total_time=20 -dict=tests/fuzz/safetensors.dict CORPUS_DIR tests/fuzz/corpus
#include <cstddef>
#include <cstdint>

#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const gmoe::SafetensorsHeader h = gmoe::parse_safetensors(data, size, "fuzz-input");
    volatile uint8_t sink = 0;
    for (const gmoe::SafetensorsEntry& e : h.tensors) {
      const uint8_t* p = data + h.data_offset + e.begin;
      for (uint64_t i = 0; i < e.nbytes(); ++i) sink = sink ^ p[i];
      if (e.has_gmoe_dtype && e.shape.size() <= 6) (void)gmoe::dtype_size(e.dtype);
    }
    (void)h.find("x");
  } catch (const gmoe::Error&) {
    // Rejected with a message: the expected outcome for malformed input.
  }
  return 0;
}
