// A few rows times a stacked weight laid out in panels, read in place, for XLA:CPU (an XLA FFI
// custom call):
//   x [M, K] float32, w [L, P, K, NR] float32, layer [] int32 -> y [M, N] float32 = x @ w[layer],
// where w[l, p, k, j] holds column p * NR + j of layer l's [K, N] weight (zeros past N, N <= P * NR:
// `weights.Panels`). XLA would copy the layer's slice out of the stacked array first (the layer
// scan's dynamic slice: every weight written once more per step) and its matrix library packs it
// again. Here each panel is a contiguous K x NR block, read once from memory in order: tasks are
// blocks of whole panels (about four a thread) over XLA's intra-op threads; each walks its block
// panel by panel, KC rows at a time (so a task's reads are one stream), and runs a
// register-blocked MR x NR product over each KC-row piece for every MR rows of x. The sums run over
// the same KC-row blocks in the same order for any M (1 row included), so a row's result does not
// depend on the other rows of the step.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "counts.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using pddjax_native::v8f;

namespace {

constexpr int64_t MR = 6;    // rows of x a product keeps in registers (12 sums, 2 + 1 loads: 15 of 16)
constexpr int64_t NR = 16;   // columns of a panel: two vectors
constexpr int64_t KC = 256;  // weight rows a block: a panel of it is KC x NR floats (16 KB)
// Up to this many rows, the first MR rows' product over a block requests the next block (the next
// 16 KB of the task's stream), a line per weight row: the block is read from memory while those
// rows compute, not after (the products of 30 layers alone: 6 rows 0.86-0.87x, 8 rows 0.87-0.93x,
// 16 rows 0.93-0.98x). With more rows the block is reused by more products and the requested one
// pushed it out of L1 (32 rows 1.04-1.08x, 64 rows 1.14x).
constexpr int64_t PREFETCH_ROWS = 16;

inline v8f splat(float a) { return v8f{a, a, a, a, a, a, a, a}; }

// c[m][0:cols] (+)= x[m][0:kc] . panel [kc, NR], m < R; c's row stride ldc, x's ldx. PF: request
// the block `next` alongside, a line per row of this one (a separate instance: the loop without
// it keeps no test per row, which cost a compute-bound 32-row step ~15%).
template <int R, bool PF>
void product(const float* x, int64_t ldx, const float* panel, int64_t kc, float* c, int64_t ldc, int64_t cols,
             bool add, const float* next) {
  v8f acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = splat(0.0f);
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) __builtin_prefetch(next + k * NR);
    v8f b0, b1;
    std::memcpy(&b0, panel + k * NR, sizeof(v8f));
    std::memcpy(&b1, panel + k * NR + 8, sizeof(v8f));
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

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (wd.size() != 4 || wd[3] != NR || xd.size() != 2 || xd[1] != wd[2] || yd.size() != 2 || yd[0] != xd[0]
      || yd[1] > wd[1] * NR || yd[1] <= (wd[1] - 1) * NR)
    return ffi::Error::InvalidArgument("x must be [M, K], w [L, P, K, 16] and y [M, N] with N in panel P");
  const int64_t L = wd[0], P = wd[1], K = wd[2], M = xd[0], N = yd[1];
  const int64_t l = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), L - 1);
  const float* ws = w.typed_data() + l * P * K * NR;
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per = std::clamp<int64_t>((P + 4 * threads - 1) / (4 * threads), 1, 16);
  const int64_t blocks = (P + per - 1) / per;
  pddjax_native::run_tasks(pool, blocks, [&](int64_t t) {
    const int64_t p1 = std::min(P, (t + 1) * per);
    for (int64_t p = t * per; p < p1; ++p) {
      const int64_t cols = std::min(NR, N - p * NR);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const float* panel = ws + (p * K + k0) * NR;
        const float* next = panel + kc * NR;  // the stream's next block
        for (int64_t m = 0; m < M; m += MR)
          pddjax_native::with_count<MR>(M - m, [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            if (m == 0 && M <= PREFETCH_ROWS)
              product<R, true>(xs + m * K + k0, K, panel, kc, ys + m * N + p * NR, N, cols, k0 > 0, next);
            else
              product<R, false>(xs + m * K + k0, K, panel, kc, ys + m * N + p * NR, N, cols, k0 > 0, nullptr);
          });
      }
    }
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
