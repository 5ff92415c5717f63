// A few rows times a stacked weight read in place, for XLA:CPU (an XLA FFI custom call):
//   x [M, K] float32, w [L, K, N] float32, layer [] int32 -> y [M, N] float32 = x @ w[layer].
// XLA would copy the layer's slice out of the stacked array first (the layer scan's dynamic
// slice: every weight written once more per step) and its matrix library packs it again.
// Here the weight is read once: tasks are blocks of whole NR-column panels (about four a thread)
// over XLA's intra-op threads; each walks its block KC rows at a time, and a register-blocked
// MR x NR product runs every MR rows of x over each panel, read as stored (a block whose columns
// are not a whole number of panels is packed first, zeros past N). Packing every block into
// contiguous panels cost more than it saved at every row count up to 64 on the machine measured.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "counts.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using pddjax_native::v8f;

namespace {

constexpr int64_t MR = 6;        // rows of x a product keeps in registers (12 sums, 2 + 1 loads: 15 of 16)
constexpr int64_t NR = 16;       // columns of a panel: two vectors
constexpr int64_t AHEAD = 16;    // panel rows requested ahead of the product's
constexpr int64_t KC = 256;      // weight rows a block: a panel of it is KC x NR floats (16 KB)

inline v8f splat(float a) { return v8f{a, a, a, a, a, a, a, a}; }

// c[m][0:NR] (+)= x[m][0:kc] . panel [kc, NR], m < R; c's row stride ldc, x's ldx; only the first
// `cols` columns of c are written.
template <int R>
void product(const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t kc, float* c, int64_t ldc,
             int64_t cols, bool add) {
  v8f acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = splat(0.0f);
  for (int64_t k = 0; k < kc; ++k) {
    // read as stored, each panel row is on a new page, where the hardware's prefetch does not go
    __builtin_prefetch(panel + (k + AHEAD) * ldp);
    v8f b0, b1;
    std::memcpy(&b0, panel + k * ldp, sizeof(v8f));
    std::memcpy(&b1, panel + k * ldp + 8, sizeof(v8f));
    for (int m = 0; m < R; ++m) {
      const v8f a = splat(x[m * ldx + k]);
      acc[m][0] += a * b0;
      acc[m][1] += a * b1;
    }
  }
  for (int m = 0; m < R; ++m) {
    float out[NR];
    std::memcpy(out, &acc[m][0], sizeof(v8f));
    std::memcpy(out + 8, &acc[m][1], sizeof(v8f));
    float* row = c + m * ldc;
    if (add)
      for (int64_t j = 0; j < cols; ++j) row[j] += out[j];
    else
      std::memcpy(row, out, size_t(cols) * sizeof(float));
  }
}

// y[:, n0:n1] = x @ w[:, n0:n1], KC weight rows at a time (each block's sums added to y in
// order, so a row's result does not depend on how many rows there are): every MR rows of x over
// each panel of the block's rows, read as stored (packed into panels, zeros past N, when the
// block's columns are not a whole number of panels).
void column_block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t n1) {
  const int64_t panels = (n1 - n0 + NR - 1) / NR;
  const bool pack = (n1 - n0) % NR != 0;  // the product reads NR columns a panel
  thread_local std::vector<float> packed;
  if (pack) packed.resize(size_t(panels * KC * NR));
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    if (pack) {
      for (int64_t k = 0; k < kc; ++k) {
        const float* row = w + (k0 + k) * N;
        for (int64_t p = 0; p < panels; ++p) {
          const int64_t c0 = n0 + p * NR, cols = std::min(NR, n1 - c0);
          float* dst = &packed[size_t((p * KC + k) * NR)];
          if (cols == NR) {
            std::memcpy(dst, row + c0, NR * sizeof(float));
          } else {
            std::copy(row + c0, row + c0 + cols, dst);
            std::fill(dst + cols, dst + NR, 0.0f);
          }
        }
      }
    }
    const int64_t next = std::min(KC, K - k0 - KC);  // the next block's rows, requested a share a panel
    for (int64_t p = 0; p < panels; ++p) {
      if (pack && next > 0)
        for (int64_t r = p * next / panels; r < (p + 1) * next / panels; ++r)
          for (int64_t c = n0; c < n1; c += 16) __builtin_prefetch(w + (k0 + KC + r) * N + c);
      const int64_t c0 = n0 + p * NR, cols = std::min(NR, n1 - c0);
      const float* panel = pack ? &packed[size_t(p * KC * NR)] : w + k0 * N + c0;
      for (int64_t m = 0; m < M; m += MR)
        pddjax_native::with_count<MR>(M - m, [&](auto rows) {
          product<decltype(rows)::value>(x + m * K + k0, K, panel, pack ? NR : N, kc, y + m * N + c0, N, cols, k0 > 0);
        });
    }
  }
}

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 3 || xd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("x must be [M, K] and w [L, K, N]");
  const int64_t L = wd[0], K = wd[1], N = wd[2], M = xd[0];
  const int64_t l = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), L - 1);
  const float* ws = w.typed_data() + l * K * N;
  // blocks of whole panels, about four a thread (at most 16 panels a block)
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t per = std::clamp<int64_t>((panels + 4 * threads - 1) / (4 * threads), 1, 16);
  const int64_t blocks = (panels + per - 1) / per;
  pddjax_native::run_tasks(pool, blocks, [&](int64_t t) {
    const int64_t n0 = t * per * NR, n1 = std::min(N, (t + 1) * per * NR);
    column_block(x.typed_data(), ws, y->typed_data(), M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PddjaxGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
