// Paged attention for XLA:CPU, as an XLA FFI custom call: reads each row's KV pages in place in
// the pool (no gathered copy), one page at a time, with a running softmax per query vector.
//
// Operands (letters as in pddjax/model/paged.py):
//   q           [T, H, D]            float32 | bfloat16, rows packed along T
//   k_pool      [L, KH, P, S, D]     float32 | bfloat16 (or [KH, P, S, D]: L = 1)
//   v_pool      like k_pool
//   layer       []  int32            which of the L layers to read
//   cu_q_lens   [B+1] int32          row r owns query tokens cu[r]:cu[r+1]
//   kv_lens     [B] int32            row r's KV length, its new tokens included
//   page_tables [B, MP] int32        row r's pages in order
//   sm_scale    attribute float      the logits' scale
// Result: out [T, H, D] in q's dtype; tokens outside every row (padding) are zeros.
// Query i of row r sits at position kv_lens[r] - q_len + i and sees KV positions 0..that one.
// Work is split by (a row's query tokens in blocks of BLOCK, KV head) over XLA's intra-op thread
// pool (parallel.h). Per page: q . K with K as stored, 4 query vectors x 2 slots at a time (the 8
// sums added across lanes together); a vectorised running softmax; p . V blocked 4 query vectors
// x 16 head dims. The page's V is requested while its K is read, and the next page's K while its V
// is: scattered 4 KB pages are read at the memory's pace only with two streams in flight.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "counts.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using pddjax_native::v8f;

namespace {

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA converts
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Copies n values at src (float32 or bfloat16) into dst as float32.
inline void load(const void* src, bool bf16, int64_t offset, int64_t n, float* dst) {
  if (bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    std::memcpy(dst, static_cast<const float*>(src) + offset, size_t(n) * sizeof(float));
  }
}

typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// e^x per lane (Cephes' expf: range reduction by ln 2, a degree-6 polynomial; ~1 ulp);
// x below -87.3 gives 0.
inline v8f vexp(v8f x) {
  const v8f low = splat(-87.3f);
  const v8f under = x < low ? splat(1.0f) : splat(0.0f);
  x = x < low ? low : x;
  x = x > splat(88.3f) ? splat(88.3f) : x;
  v8f fx = x * 1.44269504088896341f + 0.5f;
  v8f t = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8f);
  fx = t > fx ? t - 1.0f : t;  // floor
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  v8f y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  v8i e = (__builtin_convertvector(fx, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &e, sizeof(scale));
  y = y * scale;
  return under > splat(0.0f) ? splat(0.0f) : y;
}

inline float hsum(v8f a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; d + 8 <= n; d += 8) {
    v8f x, y;
    std::memcpy(&x, a + d, sizeof(x));
    std::memcpy(&y, b + d, sizeof(y));
    acc += x * y;
  }
  float s = hsum(acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline float hmax(v8f a) {
  float m = a[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, a[i]);
  return m;
}

// The 8 sums of a[0..7]'s lanes, as lanes 0..7 of one vector.
inline v8f hsum8(const v8f* a) {
#if defined(__AVX__)
  const __m256 h0 = _mm256_hadd_ps(__m256(a[0]), __m256(a[1])), h1 = _mm256_hadd_ps(__m256(a[2]), __m256(a[3]));
  const __m256 h2 = _mm256_hadd_ps(__m256(a[4]), __m256(a[5])), h3 = _mm256_hadd_ps(__m256(a[6]), __m256(a[7]));
  const __m256 lo = _mm256_hadd_ps(h0, h1), hi = _mm256_hadd_ps(h2, h3);  // [0 1 2 3 | 0 1 2 3] halves
  return v8f(_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
#else
  v8f r;
  for (int i = 0; i < 8; ++i) r[i] = hsum(a[i]);
  return r;
#endif
}

// logits[x][s] = q[x] . K[s] for NQ (<= 4) query vectors (rows of q, stride D) and a page's first
// `slots` slots of K as stored ([S, D], D in whole vectors): two slots at a time share the loads
// of q, and the 2 * NQ running sums are added across lanes together.
template <int NQ>
inline void qk_dots(const float* q, const float* kp, int64_t D, int64_t slots, int64_t SP, float* logits,
                    const float* pf) {
  for (int64_t s = 0; s < slots; s += 2) {
    if (pf != nullptr)  // the same slots of another stream (the page's V) requested alongside
      for (int64_t b = 0; b < 2 * D; b += 16) __builtin_prefetch(pf + s * D + b);
    const float* k0 = kp + s * D;
    const float* k1 = s + 1 < slots ? k0 + D : k0;
    v8f a[8];
    for (int i = 0; i < 8; ++i) a[i] = splat(0.0f);
    for (int64_t d = 0; d < D; d += 8) {
      v8f x0, x1;
      std::memcpy(&x0, k0 + d, sizeof(v8f));
      std::memcpy(&x1, k1 + d, sizeof(v8f));
      for (int x = 0; x < NQ; ++x) {
        v8f qv;
        std::memcpy(&qv, q + x * D + d, sizeof(v8f));
        a[2 * x] += qv * x0;
        a[2 * x + 1] += qv * x1;
      }
    }
    const v8f sums = hsum8(a);
    for (int x = 0; x < NQ; ++x) {
      logits[x * SP + s] = sums[2 * x];
      if (s + 1 < slots) logits[x * SP + s + 1] = sums[2 * x + 1];
    }
  }
}

// acc[x][d0 + 8v] += sum over the page's slots s of w[x][s] * V[s][d0 + 8v], for NQ (<= 4) query
// vectors.
template <int NQ, int NV>
inline void pv_block(const float* w, const float* vp, int64_t slots, int64_t D, int64_t SP, int64_t d0,
                     float* acc) {
  v8f c[NQ][NV];
  for (int x = 0; x < NQ; ++x)
    for (int v = 0; v < NV; ++v) std::memcpy(&c[x][v], acc + x * D + d0 + 8 * v, sizeof(v8f));
  for (int64_t s = 0; s < slots; ++s) {
    v8f vv[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&vv[v], vp + s * D + d0 + 8 * v, sizeof(v8f));
    for (int x = 0; x < NQ; ++x) {
      const float ws = w[x * SP + s];
      for (int v = 0; v < NV; ++v) c[x][v] += ws * vv[v];
    }
  }
  for (int x = 0; x < NQ; ++x)
    for (int v = 0; v < NV; ++v) std::memcpy(acc + x * D + d0 + 8 * v, &c[x][v], sizeof(v8f));
}

// The page's V into the sums of NQ (<= 4) query vectors, D in whole vectors.
template <int NQ>
inline void pv_rows(const float* w, const float* vp, int64_t slots, int64_t D, int64_t SP, float* acc,
                    const float* pf) {
  if (pf != nullptr)  // the next page's K requested while this page's V is read
    for (int64_t b = 0; b < slots * D; b += 16) __builtin_prefetch(pf + b);
  int64_t d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) pv_block<NQ, 2>(w, vp, slots, D, SP, d0, acc);
  for (; d0 < D; d0 += 8) pv_block<NQ, 1>(w, vp, slots, D, SP, d0, acc);
}

// One query vector's running softmax over a page: its logits lx [SP] scaled, the slots it does not
// see (from `seen` on) masked, the weights wx = e^(logit - max) written, and its max m, sum l and
// sums acc [D] rescaled when the max grows.
inline void softmax_page(float* lx, float* wx, int64_t seen, int64_t SP, float scale, float& m, float& l,
                         float* acc, int64_t D) {
  const v8f lane = {0, 1, 2, 3, 4, 5, 6, 7};
  v8f top = splat(-INFINITY);
  for (int64_t b = 0; b < SP; b += 8) {
    v8f z;
    std::memcpy(&z, lx + b, sizeof(z));
    z = lane + float(b) < splat(float(seen)) ? z * scale : splat(-INFINITY);
    std::memcpy(lx + b, &z, sizeof(z));
    top = top > z ? top : z;
  }
  const float m_new = std::max(m, hmax(top));
  v8f sum = splat(0.0f);
  for (int64_t b = 0; b < SP; b += 8) {
    v8f z;
    std::memcpy(&z, lx + b, sizeof(z));
    z = vexp(z - m_new);
    std::memcpy(wx + b, &z, sizeof(z));
    sum += z;
  }
  if (m_new > m) {  // the sums so far were against a smaller max (none yet on the first page: m = -inf)
    const float keep = std::exp(m - m_new);
    for (int64_t d = 0; d < D; ++d) acc[d] *= keep;
    l *= keep;
    m = m_new;
  }
  l += hsum(sum);
}

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  bool q_bf16, kv_bf16;
  int64_t num_tokens, num_heads, num_kv_heads, group, num_pages, page_size, head_dim, max_pages;
  int64_t layer_offset;  // elements before the layer's [KH, P, S, D] block
  int64_t num_rows;
  const int32_t* cu;
  const int32_t* kv_lens;
  const int32_t* tables;
  float scale;
};

// Query tokens [begin, end) of one row against one KV head's pages, a page at a time: the page's
// logits for every query vector, a running softmax per vector, then the page's V into the sums.
void attend(const Problem& p, int64_t row, int64_t begin, int64_t end, int64_t kv_head) {
  const int64_t D = p.head_dim, S = p.page_size, G = p.group;
  const int64_t q0 = int64_t(p.cu[row]) + begin, q_len = end - begin;
  const int64_t kv_len = std::min<int64_t>(p.kv_lens[row], p.max_pages * S);
  // position of query `begin` (the row's query tokens are its last KV positions)
  const int64_t first = kv_len - (int64_t(p.cu[row + 1]) - p.cu[row]) + begin;
  if (kv_len <= 0 || first + q_len <= 0) return;
  const int64_t n = q_len * G;  // query vectors: x = i * G + g
  const bool vec = D % 8 == 0;  // head size in whole vectors: the blocked products
  const int64_t SP = (S + 7) / 8 * 8;  // a page's slots, padded to whole vectors
  // one buffer for the task: q, acc [n, D]; m, l [n]; logits, w [n, SP]; K, V [S, D] (bfloat16)
  thread_local std::vector<float> scratch;
  const int64_t kv_copy = p.kv_bf16 ? S * D : 0;
  scratch.assign(2 * n * D + 2 * n + 2 * n * SP + 2 * kv_copy, 0.0f);
  float* qv = scratch.data();
  float* acc = qv + n * D;
  float* m = acc + n * D;
  float* l = m + n;
  float* logits = l + n;
  float* w = logits + n * SP;
  float* kpage = w + n * SP;
  float* vpage = kpage + kv_copy;
  std::fill(m, m + n, -INFINITY);
  for (int64_t i = 0; i < q_len; ++i)
    for (int64_t g = 0; g < G; ++g)
      load(p.q, p.q_bf16, ((q0 + i) * p.num_heads + kv_head * G + g) * D, D, &qv[(i * G + g) * D]);
  const int64_t head_offset = p.layer_offset + kv_head * p.num_pages * S * D;
  const int64_t pages = (first + q_len - 1) / S + 1;  // those the block's last query sees
  auto page_at = [&](int64_t j) {  // the row's j-th page, kept inside the pool
    return std::min<int64_t>(std::max<int64_t>(p.tables[row * p.max_pages + j], 0), p.num_pages - 1);
  };
  for (int64_t j = 0; j < pages; ++j) {
    const int64_t page = page_at(j);
    const int64_t in_page = std::min<int64_t>(S, kv_len - j * S);
    // float32: the page's V is requested alongside its K (q . K), the next page's K alongside this
    // page's V (p . V): two streams in flight at once, which scattered pages need to be read at the
    // memory's pace. bfloat16 (copied to float32 first): the next page's K and V requested at once.
    const float* next_k = nullptr;
    if (j + 1 < pages) {
      const int64_t next = page_at(j + 1);
      if (!p.kv_bf16) {
        next_k = static_cast<const float*>(p.k) + head_offset + next * S * D;
      } else {
        const int64_t bytes = S * D * 2, at = (head_offset + next * S * D) * 2;
        for (int64_t b = 0; b < bytes; b += 64) {
          __builtin_prefetch(static_cast<const char*>(p.k) + at + b);
          __builtin_prefetch(static_cast<const char*>(p.v) + at + b);
        }
      }
    }
    const float* kp;
    const float* vp;
    if (p.kv_bf16) {
      load(p.k, true, head_offset + page * S * D, in_page * D, kpage);
      load(p.v, true, head_offset + page * S * D, in_page * D, vpage);
      kp = kpage;
      vp = vpage;
    } else {
      kp = static_cast<const float*>(p.k) + head_offset + page * S * D;
      vp = static_cast<const float*>(p.v) + head_offset + page * S * D;
    }
    // the first `skip` query vectors are before this page (later tokens see more)
    const int64_t skip = std::min<int64_t>(n, std::max<int64_t>(0, j * S - first) * G);
    if (skip == n) continue;
    if (vec) {
      for (int64_t x = skip; x < n; x += 4)
        pddjax_native::with_count<4>(n - x, [&](auto nq) {
          qk_dots<decltype(nq)::value>(&qv[x * D], kp, D, in_page, SP, &logits[x * SP],
                                       x == skip && !p.kv_bf16 ? vp : nullptr);
        });
    } else {
      for (int64_t x = skip; x < n; ++x)
        for (int64_t s = 0; s < in_page; ++s) logits[x * SP + s] = dot(&qv[x * D], kp + s * D, D);
    }
    for (int64_t x = skip; x < n; ++x) {
      const int64_t seen = std::min<int64_t>(in_page, first + x / G - j * S + 1);
      softmax_page(&logits[x * SP], &w[x * SP], seen, SP, p.scale, m[x], l[x], &acc[x * D], D);
    }
    if (vec) {
      for (int64_t x = skip; x < n; x += 4)
        pddjax_native::with_count<4>(n - x, [&](auto nq) {
          pv_rows<decltype(nq)::value>(&w[x * SP], vp, in_page, D, SP, &acc[x * D], x == skip ? next_k : nullptr);
        });
    } else {
      for (int64_t x = skip; x < n; ++x)
        for (int64_t s = 0; s < in_page; ++s)
          for (int64_t d = 0; d < D; ++d) acc[x * D + d] += w[x * SP + s] * vp[s * D + d];
    }
  }
  for (int64_t i = 0; i < q_len; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t x = i * G + g;
      const float inv = l[x] > 0 ? 1.0f / l[x] : 0.0f;
      const int64_t at = ((q0 + i) * p.num_heads + kv_head * G + g) * D;
      if (p.q_bf16) {
        uint16_t* o = static_cast<uint16_t*>(p.out) + at;
        for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(acc[x * D + d] * inv);
      } else {
        float* o = static_cast<float*>(p.out) + at;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[x * D + d] * inv;
      }
    }
  }
}

// A row's query tokens go in blocks of at most BLOCK (one task per block and KV head), so a long
// row spreads over the threads too.
constexpr int64_t BLOCK = 16;

struct Block {
  int64_t row, begin, end;
};

bool is_float(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_tables, float sm_scale,
                              ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3) return ffi::Error::InvalidArgument("q must be [T, H, D]");
  if (kd.size() != 4 && kd.size() != 5) return ffi::Error::InvalidArgument("the pool must be [L, KH, P, S, D]");
  if (!is_float(q.element_type()) || !is_float(k.element_type()) || k.element_type() != v.element_type() ||
      out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("q and the pool must be float32 or bfloat16; out as q");
  const size_t r = kd.size();
  const int64_t num_layers = r == 5 ? kd[0] : 1;
  Problem p;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.q_bf16 = q.element_type() == ffi::DataType::BF16;
  p.kv_bf16 = k.element_type() == ffi::DataType::BF16;
  p.num_tokens = qd[0];
  p.num_heads = qd[1];
  p.head_dim = qd[2];
  p.num_kv_heads = kd[r - 4];
  p.num_pages = kd[r - 3];
  p.page_size = kd[r - 2];
  if (kd[r - 1] != p.head_dim || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0)
    return ffi::Error::InvalidArgument("q's heads and head size do not match the pool's");
  p.group = p.num_heads / p.num_kv_heads;
  auto td = page_tables.dimensions();
  if (td.size() != 2 || cu_q_lens.element_count() != size_t(td[0]) + 1 || kv_lens.element_count() != size_t(td[0]))
    return ffi::Error::InvalidArgument("cu_q_lens [B+1], kv_lens [B] and page_tables [B, MP] disagree");
  p.num_rows = td[0];
  p.max_pages = td[1];
  const int64_t at = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), num_layers - 1);
  p.layer_offset = at * p.num_kv_heads * p.num_pages * p.page_size * p.head_dim;
  p.cu = cu_q_lens.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.tables = page_tables.typed_data();
  p.scale = sm_scale;
  std::memset(p.out, 0, out->size_bytes());

  std::vector<Block> blocks;
  for (int64_t row = 0; row < p.num_rows; ++row) {
    const int64_t q_len = int64_t(p.cu[row + 1]) - p.cu[row];
    if (q_len <= 0 || p.cu[row] < 0 || int64_t(p.cu[row + 1]) > p.num_tokens) continue;  // padding
    for (int64_t b = 0; b < q_len; b += BLOCK) blocks.push_back({row, b, std::min(q_len, b + BLOCK)});
  }
  pddjax_native::run_tasks(pool, int64_t(blocks.size()) * p.num_kv_heads, [&](int64_t t) {
    const Block& b = blocks[t / p.num_kv_heads];
    attend(p, b.row, b.begin, b.end, t % p.num_kv_heads);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PddjaxPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>());
