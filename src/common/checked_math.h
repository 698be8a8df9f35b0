// src/common/checked_math.h — size arithmetic that reports overflow instead of wrapping.
//
// Sizes come from callers and from files (shapes, counts, offsets): every product or sum of them
// goes through these, so a size that does not fit in 64 bits is a gmoe::Error naming what was
// being computed, never a wrapped value that slips past a later check.
#pragma once

#include <cstdint>

#include "gmoe/error.h"

namespace gmoe {

/// a * b; throws gmoe::Error naming `what` when the product does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    GMOE_FAIL(what, ": ", a, " x ", b, " overflows 64-bit sizes");
  }
  return r;
}

/// a + b; throws gmoe::Error naming `what` when the sum does not fit in int64.
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) {
    GMOE_FAIL(what, ": ", a, " + ", b, " overflows 64-bit sizes");
  }
  return r;
}

/// The number of elements of sizes [first, last): 0 when one size is 0, else their product. The
/// product of the non-zero sizes must fit even when one size is 0, since the contiguous strides
/// are products of them ([0, 2^62, 4] holds no element, but its first stride 2^64 does not fit).
/// Throws gmoe::Error naming `what` on a negative size or a product past int64.
template <typename It>
int64_t checked_numel(It first, It last, const char* what) {
  int64_t n = 1;
  bool empty = false;
  for (It it = first; it != last; ++it) {
    const int64_t s = *it;
    if (s < 0) GMOE_FAIL(what, ": negative size ", s);
    if (s == 0) {
      empty = true;
    } else {
      n = checked_mul(n, s, what);
    }
  }
  return empty ? 0 : n;
}

/// checked_numel over a whole container.
template <typename Container>
int64_t checked_numel(const Container& sizes, const char* what) {
  return checked_numel(sizes.begin(), sizes.end(), what);
}

}  // namespace gmoe
