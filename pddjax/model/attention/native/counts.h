// A run-time count as a compile-time one, for kernels templated on how many rows they keep in
// registers: with_count<MAX>(n, f) calls f(std::integral_constant<int, c>{}) with c = n clamped to
// 1 .. MAX (read it in f as decltype(c)::value).

#pragma once

#include <cstdint>
#include <type_traits>

namespace pddjax_native {

template <int MAX, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (MAX > 1) {
    if (n < MAX) return with_count<MAX - 1>(n, f);
  }
  f(std::integral_constant<int, MAX>{});
}

}  // namespace pddjax_native
