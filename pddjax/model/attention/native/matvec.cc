// One row times a stacked weight read in place, for XLA:CPU (an XLA FFI custom call):
//   x [1, K] float32, w [L, K, N] float32, layer [] int32 -> y [1, N] float32 = x @ w[layer].
// The weight's rows are split in chunks over XLA's intra-op threads; each chunk streams its rows
// (contiguous, once) into a partial [N] sum, and the partials are added in chunk order. XLA
// instead copies the layer's slice out of the stacked array before its product (the layer scan's
// dynamic slice), which was most of a one-row decode step's time above its floor.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
typedef float v8f __attribute__((vector_size(32)));
namespace {

struct Shared {
  const float *x, *w; float* y; int64_t K, N, chunks, rows;
  std::vector<float> partial;  // [chunks, N]
  std::atomic<int64_t> next{0}, done{0}; std::mutex mu; std::condition_variable cv;
  void work() {
    for (int64_t t; (t = next.fetch_add(1)) < chunks;) {
      float* acc = &partial[t * N];
      std::fill(acc, acc + N, 0.f);
      const int64_t k0 = t * rows, k1 = std::min(K, k0 + rows);
      for (int64_t k = k0; k < k1; ++k) {
        const float a = x[k];
        const float* wr = w + k * N;
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
          v8f wv, av; std::memcpy(&wv, wr + n, 32); std::memcpy(&av, acc + n, 32);
          av += a * wv; std::memcpy(acc + n, &av, 32);
        }
        for (; n < N; ++n) acc[n] += a * wr[n];
      }
      if (done.fetch_add(1) + 1 == chunks) { std::lock_guard<std::mutex> l(mu); cv.notify_all(); }
    }
  }
};
}  // namespace

static ffi::Error MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions(), xd = x.dimensions();
  if (wd.size() != 3 || xd.size() != 2 || xd[0] != 1 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("x must be [1, K] and w [L, K, N]");
  int64_t L = wd[0], K = wd[1], N = wd[2];
  int64_t l = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), L - 1);
  auto s = std::make_shared<Shared>();
  s->x = x.typed_data(); s->w = w.typed_data() + l * K * N; s->y = y->typed_data(); s->K = K; s->N = N;
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  s->chunks = threads * 4; s->rows = (K + s->chunks - 1) / s->chunks; s->chunks = (K + s->rows - 1) / s->rows;
  s->partial.resize(s->chunks * N);
  int64_t helpers = std::min<int64_t>(threads - 1, s->chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { s->work(); });
  s->work();
  { std::unique_lock<std::mutex> lk(s->mu); s->cv.wait(lk, [&] { return s->done.load() == s->chunks; }); }
  float* out = s->y;
  std::memcpy(out, &s->partial[0], N * 4);
  for (int64_t c = 1; c < s->chunks; ++c) for (int64_t n = 0; n < N; ++n) out[n] += s->partial[c * N + n];
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(PddjaxMatvec, MatvecImpl, ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());
