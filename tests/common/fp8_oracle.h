// tests/common/fp8_oracle.h — an independent scalar implementation of the FP8 format of
// gmoe/fp8.h, written from the spec without the library's code (fp8_rules.h): element encoding by
// nearest-value search in the table of all codes, decoding by ldexp, scales with ilogb/ldexp, and
// the expected outputs of quantize_grouped / quantize_weights as host byte tensors. The CPU suite
// checks the CPU backend against it bit for bit; the CUDA suite checks the GPU against the CPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/harness.h"
#include "gmoe/fp8.h"

namespace gmoe::test::fp8 {

/// The value of an fp8 byte (NaN for NaN codes; ±inf for e5m2 infinities).
double decode(uint8_t b, DType format);
/// Round to nearest (ties to the even code), saturate to ±max (inf included), NaN -> 0x7F.
uint8_t encode(float y, DType format);
/// Largest finite value; mantissa bits; exponent of the smallest normal.
double max_value(DType format);
int mantissa_bits(DType format);
int min_normal_exp(DType format);

/// Expected quantize outputs (contiguous, layouts of fp8_grouped_layout / fp8_weights_layout).
struct Expected {
  HostTensor data, scale_inv, data_t, scale_inv_t, padded_offsets;
};
/// x: host [capacity, cols] (any float dtype); counts valid (sum <= capacity).
Expected oracle_grouped(const HostTensor& x, const std::vector<int64_t>& counts,
                        const Fp8QuantizeOptions& o);
/// w: host [E, N, K] stacked.
Expected oracle_weights(const HostTensor& w, const Fp8QuantizeOptions& o);

/// Bytes of a host view (any dtype) as a HostTensor of the same shape, for comparisons.
HostTensor host_copy(const TensorView& v);
/// Byte-for-byte equality, reporting the first differing element (by element index).
::testing::AssertionResult same_bytes(const HostTensor& got, const HostTensor& want,
                                      const std::string& what);
/// Fills every byte with 0xA5 (an fp8 value, an odd scale) so unwritten outputs show.
void poison_bytes(HostTensor& t);

/// The per-element error bound of a quantize/dequantize round trip of x with dequantization
/// multiplier `scale_inv` (see docs/architecture.md, "FP8 operands"): for a value that does not
/// saturate, |x - deq| <= 2^-(m+1) |x| + 2^(emin-m-1) scale_inv + 2^-20 |x| + 2^-140, m the mantissa
/// bits, emin the smallest normal exponent. Saturated (|x| > max * scale_inv): deq = ±max *
/// scale_inv exactly (up to the same f32 slack). A dequantized ±inf passes only where |x| plus the
/// bound reaches past FLT_MAX (the f32 result of the dequantization overflows).
bool within_round_trip_bound(double x, double deq, double scale_inv, DType format);

}  // namespace gmoe::test::fp8
