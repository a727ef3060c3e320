// ops.fixed_sum's tree, shared by the library's sources (norms.cpp, gated_delta.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace fixed_tree {

inline int64_t pow2_at_least(int64_t n) {
  int64_t width = 1;
  while (width < n) width <<= 1;
  return width;
}

// ops.fixed_sum of one row already in buf[0:n]: zero-padded to a power of two, then element i
// paired with i + width/2 at every level.
inline float tree_sum(float* buf, int64_t n, int64_t width) {
  std::fill(buf + n, buf + width, 0.0f);
  while (width > 1) {
    width /= 2;
    for (int64_t i = 0; i < width; ++i) buf[i] = buf[i] + buf[i + width];
  }
  return buf[0];
}

}  // namespace fixed_tree
