// One row times a stacked weight read in place, for XLA:CPU (an XLA FFI custom call):
//   x [1, K] float32, w [L, K, N] float32, layer [] int32 -> y [1, N] float32 = x @ w[layer].
// The weight's rows are split in chunks over XLA's intra-op threads; each chunk streams its rows
// (contiguous, once; four rows a pass over the sum, the next four requested meanwhile) into a
// partial [N] sum, and the partials are added in chunk order. XLA instead copies the layer's
// slice out of the stacked array before its product (the layer scan's dynamic slice), which was
// most of a one-row decode step's time above its floor.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using pddjax_native::v8f;

static ffi::Error MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 3 || xd.size() != 2 || xd[0] != 1 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("x must be [1, K] and w [L, K, N]");
  const int64_t L = wd[0], K = wd[1], N = wd[2];
  const int64_t l = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), L - 1);
  const float* xs = x.typed_data();
  const float* ws = w.typed_data() + l * K * N;
  // chunks of rows (a multiple of four): four chunks a thread, so a slow thread is not everyone's wait
  int64_t chunks = std::max<int64_t>(pool.num_threads(), 1) * 4;
  const int64_t rows = ((K + chunks - 1) / chunks + 3) / 4 * 4;
  chunks = (K + rows - 1) / rows;
  std::vector<float> partial(chunks * N, 0.0f);  // [chunks, N]
  pddjax_native::run_tasks(pool, chunks, [&](int64_t t) {
    float* acc = &partial[t * N];
    const int64_t k1 = std::min(K, (t + 1) * rows);
    int64_t k = t * rows;
    for (; k + 4 <= k1; k += 4) {  // four weight rows a pass: the partial sums read and written once
      const float a0 = xs[k], a1 = xs[k + 1], a2 = xs[k + 2], a3 = xs[k + 3];
      const float *w0 = ws + k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
      int64_t n = 0;
      for (; n + 8 <= N; n += 8) {
        __builtin_prefetch(w0 + n + 4 * N, 0, 0);  // the next pass's four rows
        __builtin_prefetch(w1 + n + 4 * N, 0, 0);
        __builtin_prefetch(w2 + n + 4 * N, 0, 0);
        __builtin_prefetch(w3 + n + 4 * N, 0, 0);
        v8f v0, v1, v2, v3, av;
        std::memcpy(&v0, w0 + n, 32);
        std::memcpy(&v1, w1 + n, 32);
        std::memcpy(&v2, w2 + n, 32);
        std::memcpy(&v3, w3 + n, 32);
        std::memcpy(&av, acc + n, 32);
        av += a0 * v0 + a1 * v1 + a2 * v2 + a3 * v3;
        std::memcpy(acc + n, &av, 32);
      }
      for (; n < N; ++n) acc[n] += a0 * w0[n] + a1 * w1[n] + a2 * w2[n] + a3 * w3[n];
    }
    for (; k < k1; ++k) {  // the chunk's last rows (K not a multiple of four)
      const float a = xs[k];
      const float* wr = ws + k * N;
      for (int64_t n = 0; n < N; ++n) acc[n] += a * wr[n];
    }
  });
  float* out = y->typed_data();
  std::memcpy(out, partial.data(), N * sizeof(float));
  for (int64_t c = 1; c < chunks; ++c)
    for (int64_t n = 0; n < N; ++n) out[n] += partial[c * N + n];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PddjaxMatvec, MatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
