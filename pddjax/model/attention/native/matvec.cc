// One row times a stacked weight read in place, for XLA:CPU (an XLA FFI custom call):
//   x [1, K] float32, w [L, K, N] float32, layer [] int32 -> y [1, N] float32 = x @ w[layer].
// The weight's rows are split in chunks over XLA's intra-op threads; each chunk streams its rows
// (contiguous, once) into a partial [N] sum, and the partials are added in chunk order. XLA
// instead copies the layer's slice out of the stacked array before its product (the layer scan's
// dynamic slice), which was most of a one-row decode step's time above its floor.

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
  // chunks of rows: four a thread, so a slow thread is not everyone's wait
  int64_t chunks = std::max<int64_t>(pool.num_threads(), 1) * 4;
  const int64_t rows = (K + chunks - 1) / chunks;
  chunks = (K + rows - 1) / rows;
  std::vector<float> partial(chunks * N, 0.0f);  // [chunks, N]
  pddjax_native::run_tasks(pool, chunks, [&](int64_t t) {
    float* acc = &partial[t * N];
    for (int64_t k = t * rows; k < std::min(K, (t + 1) * rows); ++k) {
      const float a = xs[k];
      const float* wr = ws + k * N;
      int64_t n = 0;
      for (; n + 8 <= N; n += 8) {
        v8f wv, av;
        std::memcpy(&wv, wr + n, 32);
        std::memcpy(&av, acc + n, 32);
        av += a * wv;
        std::memcpy(acc + n, &av, 32);
      }
      for (; n < N; ++n) acc[n] += a * wr[n];
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
