// Decode attention over the contiguous KV cache in float32, one new token per slot: the
// attention of a decode step on the CPU.
//
// Why: XLA's CPU backend runs a decode step's attention as two batched dots per layer over
// a window of the cache, copying that window out first (engines.kv_cache reads the longest
// live slot rounded up to a power of two). Here each (slot, kv head) reads exactly its live
// entries, once, in the cache's memory order, with the softmax in between in registers and
// L1; AVX2 + FMA, 16-float vectors where the build targets AVX-512. engines/cpu_kernels.py
// builds it and registers it as the XLA FFI target
// "jetserve_decode_attention"; engines.kv_cache.DecodeKV uses it.
//
// Layouts, as engines.kv_cache keeps them: q [B, N, H], keys [L, Bc, K, H, S], values
// [L, Bc, K, S, H], layer i32[], pos i32[B], Bc >= B: a step over the first B slots of a
// cache of Bc reads those rows in place. The cache is a stack of L layers of which
// `layer` picks one, read in place: a scanned decoder (engines/layer_scan.py) passes its
// stacked cache whole with the layer's index, where a slice would make XLA copy the layer
// out first; the loop passes one layer as [1, ...] and 0. An index outside [0, L) is an
// error, never a read out of bounds. Entry j of a slot holds sequence position j, so a slot at
// position p (clamped to S - 1) sees entries max(0, p - window + 1) .. p (window 0: no
// sliding window); a slot at p < 0 is not live: its output is zeros and nothing of it is
// read. The N query heads share kv heads in groups of N / K, as in the model.
//
// "jetserve_paged_decode_attention" is the same attention over the paged KV store
// (engines/paged_kv.py): pools [L, K, P + 1, ps, H] of keys and values alike, table i32[B, W]
// each slot's pages in position order (entry j of slot b at page table[b, j / ps], row
// j % ps). Each (slot, kv head) copies its live entries out of their pages into a
// contiguous block (keys transposed) and runs the contiguous path above on it: the pages
// are read once, in position order, where XLA's gather path copies every slot's whole
// table width out of the pool per layer. Page indices outside [0, P + 1) read the last page
// (the trash page), never out of bounds; a position past the table's width clamps to it.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// scores[g, j] = q[g, :] . k[:, j0 + j] for the G query heads of one kv head. k [H, S] is
// read 4 rows at a time (4 short streams: one load of each feeds all G heads, and each
// score vector is loaded and stored once per 4 rows). Software prefetch, of the rows ahead
// or of the next task's keys and values, made the kernel slower on both machines measured
// (AMD Zen 3 with AVX2, Intel Xeon with AVX-512; docs/BENCHMARKS.md).
void scores_any(const float* q, const float* k, int64_t G, int64_t H, int64_t S, int64_t j0,
                int64_t n, float* scores) {
  std::fill(scores, scores + G * n, 0.f);
  int64_t h = 0;
  for (; h + 4 <= H; h += 4) {
    const float* k0 = k + h * S + j0;
    const float *k1 = k0 + S, *k2 = k1 + S, *k3 = k2 + S;
    int64_t j = 0;
#ifdef __AVX512F__
    for (; j < n; j += 16) {  // 16 entries a vector, the last ones masked
      const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 a = _mm512_maskz_loadu_ps(m, k0 + j), b = _mm512_maskz_loadu_ps(m, k1 + j);
      const __m512 c = _mm512_maskz_loadu_ps(m, k2 + j), d = _mm512_maskz_loadu_ps(m, k3 + j);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * H + h;
        float* sg = scores + g * n + j;
        __m512 acc = _mm512_maskz_loadu_ps(m, sg);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qg[0]), a, acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qg[1]), b, acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qg[2]), c, acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qg[3]), d, acc);
        _mm512_mask_storeu_ps(sg, m, acc);
      }
    }
#endif
    for (; j + 8 <= n; j += 8) {
      const __m256 a = _mm256_loadu_ps(k0 + j), b = _mm256_loadu_ps(k1 + j);
      const __m256 c = _mm256_loadu_ps(k2 + j), d = _mm256_loadu_ps(k3 + j);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * H + h;
        float* sg = scores + g * n + j;
        __m256 acc = _mm256_loadu_ps(sg);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(qg[0]), a, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(qg[1]), b, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(qg[2]), c, acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(qg[3]), d, acc);
        _mm256_storeu_ps(sg, acc);
      }
    }
    for (; j < n; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * H + h;
        scores[g * n + j] += qg[0] * k0[j] + qg[1] * k1[j] + qg[2] * k2[j] + qg[3] * k3[j];
      }
  }
  for (; h < H; ++h) {
    const float* kh = k + h * S + j0;
    for (int64_t g = 0; g < G; ++g) {
      const float qh = q[g * H + h];
      float* sg = scores + g * n;
      for (int64_t j = 0; j < n; ++j) sg[j] += qh * kh[j];
    }
  }
}

// Softmax of scale * s in place, over n entries.
void softmax(float* s, int64_t n, float scale) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  mx *= scale;
  const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = jetserve::exp_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), vs, vm));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = jetserve::hsum(vsum);
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] * scale - mx));
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
  for (; j < n; ++j) s[j] /= sum;
}

// out[g, h0:h0+16] (+)= sum_j p[g, j] v[j0 + j, h0:h0+16] over j in [ja, jb), two vectors
// per head in registers.
template <int G>
void values_block(const float* p, int64_t n, const float* v, int64_t H, int64_t j0,
                  int64_t ja, int64_t jb, int64_t h0, float* out, bool accumulate) {
  __m256 acc[G][2];
  for (int g = 0; g < G; ++g) {
    acc[g][0] = accumulate ? _mm256_loadu_ps(out + g * H + h0) : _mm256_setzero_ps();
    acc[g][1] = accumulate ? _mm256_loadu_ps(out + g * H + h0 + 8) : _mm256_setzero_ps();
  }
  for (int64_t j = ja; j < jb; ++j) {
    const float* vj = v + (j0 + j) * H + h0;
    const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
    for (int g = 0; g < G; ++g) {
      const __m256 pg = _mm256_set1_ps(p[g * n + j]);
      acc[g][0] = _mm256_fmadd_ps(pg, v0, acc[g][0]);
      acc[g][1] = _mm256_fmadd_ps(pg, v1, acc[g][1]);
    }
  }
  for (int g = 0; g < G; ++g) {
    _mm256_storeu_ps(out + g * H + h0, acc[g][0]);
    _mm256_storeu_ps(out + g * H + h0 + 8, acc[g][1]);
  }
}

#ifdef __AVX512F__
// out[g, h0:h0 + 64] = sum_j p[g, j] v[j0 + j, h0:h0 + 64] over all n entries for GB heads,
// four 16-float vectors per head in registers (masked to the hw <= 64 heads' columns left):
// the values are read in memory order, once per 64 columns.
template <int GB>
void values_block512(const float* p, int64_t n, const float* v, int64_t H, int64_t j0,
                     int64_t h0, int64_t hw, float* out) {
  __mmask16 m[4];
  for (int i = 0; i < 4; ++i) {
    const int64_t w = std::clamp<int64_t>(hw - 16 * i, 0, 16);
    m[i] = w == 16 ? 0xFFFF : static_cast<__mmask16>((1u << w) - 1);
  }
  __m512 acc[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + (j0 + j) * H + h0;
    __m512 x[4];
    for (int i = 0; i < 4; ++i) x[i] = _mm512_maskz_loadu_ps(m[i], vj + 16 * i);
    for (int g = 0; g < GB; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * n + j]);
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(pg, x[i], acc[g][i]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(out + g * H + h0 + 16 * i, m[i], acc[g][i]);
}

void values_any(const float* p, const float* v, int64_t G, int64_t H, int64_t j0, int64_t n,
                float* out) {
  for (int64_t h0 = 0; h0 < H; h0 += 64) {
    const int64_t hw = std::min<int64_t>(64, H - h0);
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) values_block512<4>(p + g * n, n, v, H, j0, h0, hw, out + g * H);
    for (; g + 2 <= G; g += 2) values_block512<2>(p + g * n, n, v, H, j0, h0, hw, out + g * H);
    for (; g < G; ++g) values_block512<1>(p + g * n, n, v, H, j0, h0, hw, out + g * H);
  }
}
#else
// out [G, H] = p [G, n] . v [j0:j0 + n, H]. The entries go in blocks of kValueRows, each
// block's rows whole (every 16-head slice of them) before the next, so the values are
// read from memory in order, once; the partial sums wait in out, in L1.
constexpr int64_t kValueRows = 16;

void values_any(const float* p, const float* v, int64_t G, int64_t H, int64_t j0, int64_t n,
                float* out) {
  const int64_t h16 = H / 16 * 16;
  for (int64_t ja = 0; ja < n; ja += kValueRows) {
    const int64_t jb = std::min(n, ja + kValueRows);
    for (int64_t h0 = 0; h0 < h16; h0 += 16) {
      int64_t g = 0;
      for (; g + 4 <= G; g += 4)
        values_block<4>(p + g * n, n, v, H, j0, ja, jb, h0, out + g * H, ja > 0);
      for (; g < G; ++g) values_block<1>(p + g * n, n, v, H, j0, ja, jb, h0, out + g * H, ja > 0);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t h = h16; h < H; ++h) {
      float o = 0.f;
      for (int64_t j = 0; j < n; ++j) o += p[g * n + j] * v[(j0 + j) * H + h];
      out[g * H + h] = o;
    }
}
#endif

// out [G, H] for the G query heads q [G, H] of one kv head over keys k [H, S] and values
// v [S, H], entries j0 .. j1 - 1.
void attend_group(const float* q, const float* k, const float* v, float* out, int64_t G,
                  int64_t H, int64_t S, int64_t j0, int64_t j1, float* scores) {
  const int64_t n = j1 - j0;
  scores_any(q, k, G, H, S, j0, n, scores);
  for (int64_t g = 0; g < G; ++g) softmax(scores + g * n, n, 1.0f / std::sqrt(static_cast<float>(H)));
  values_any(scores, v, G, H, j0, n, out);
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out,
                           int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || layer.element_count() != 1 ||
      pos.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "jetserve_decode_attention expects q [B, N, H], k [L, B, K, H, S], "
        "v [L, B, K, S, H], layer i32[], pos [B]");
  // The cache may hold more slots than the step has queries (Bc >= B): a step over the
  // first B slots only (a decode batch bucket) reads rows 0 .. B - 1 of it in place.
  const int64_t B = qd[0], N = qd[1], H = qd[2], L = kd[0], Bc = kd[1], K = kd[2], S = kd[4];
  if (Bc < B || kd[3] != H || vd[0] != L || vd[1] != Bc || vd[2] != K || vd[3] != S ||
      vd[4] != H || pos.dimensions()[0] != B || K == 0 || N % K != 0)
    return ffi::Error::InvalidArgument("jetserve_decode_attention: shapes do not agree");
  const int64_t i = layer.typed_data()[0];
  if (i < 0 || i >= L)
    return ffi::Error::InvalidArgument("jetserve_decode_attention: layer " +
                                       std::to_string(i) + " is outside [0, " +
                                       std::to_string(L) + ")");
  const int64_t G = N / K;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data() + i * Bc * K * H * S;
  const float* vp = v.typed_data() + i * Bc * K * S * H;
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  auto live = [=](int64_t t, int64_t* j0, int64_t* j1) {  // entries [j0, j1) of task t
    const int64_t p = std::min<int64_t>(pp[t / K], S - 1);
    *j0 = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    *j1 = p < 0 ? *j0 : p + 1;
  };
  // One task per (slot, kv head).
  jetserve::parallel_for(pool, B * K, [=](int64_t t) {
    thread_local std::vector<float> scores;
    scores.resize(G * S);
    int64_t j0, j1;
    live(t, &j0, &j1);
    float* o = op + t * G * H;  // (b, kv head) t's query heads: b N + kh G = t G
    if (j1 > j0)
      attend_group(qp + t * G * H, kp + t * H * S, vp + t * S * H, o, G, H, S, j0, j1,
                   scores.data());
    else
      std::fill(o, o + G * H, 0.f);
  });
  return ffi::Error::Success();
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> layer,
                                ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out,
                                int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || td.size() != 2 ||
      layer.element_count() != 1 || pos.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "jetserve_paged_decode_attention expects q [B, N, H], k and v [L, K, P + 1, ps, H], "
        "table i32[B, W], layer i32[], pos [B]");
  const int64_t B = qd[0], N = qd[1], H = qd[2], L = kd[0], K = kd[1], P1 = kd[2];
  const int64_t ps = kd[3], W = td[1];
  for (int d = 0; d < 5; ++d)
    if (vd[d] != kd[d])
      return ffi::Error::InvalidArgument("jetserve_paged_decode_attention: keys and values "
                                         "pools differ in shape");
  if (kd[4] != H || td[0] != B || pos.dimensions()[0] != B || K == 0 || N % K != 0 ||
      P1 < 1 || ps < 1 || W < 1)
    return ffi::Error::InvalidArgument("jetserve_paged_decode_attention: shapes do not agree");
  const int64_t i = layer.typed_data()[0];
  if (i < 0 || i >= L)
    return ffi::Error::InvalidArgument("jetserve_paged_decode_attention: layer " +
                                       std::to_string(i) + " is outside [0, " +
                                       std::to_string(L) + ")");
  const int64_t G = N / K, S = W * ps;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data() + i * K * P1 * ps * H;
  const float* vp = v.typed_data() + i * K * P1 * ps * H;
  const int32_t* tp = table.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  // One task per (slot, kv head), as the contiguous kernel's.
  jetserve::parallel_for(pool, B * K, [=](int64_t t) {
    thread_local std::vector<float> scores, keys, values;
    const int64_t b = t / K, kh = t % K;
    const int64_t p = std::min<int64_t>(pp[b], S - 1);
    const int64_t j0 = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    const int64_t n = p < 0 ? 0 : p + 1 - j0;
    float* o = op + t * G * H;
    if (n <= 0) {
      std::fill(o, o + G * H, 0.f);
      return;
    }
    scores.resize(G * n);
    keys.resize(H * n);
    values.resize(n * H);
    const int64_t head = kh * P1 * ps * H;  // the kv head's pages in the layer's pool
    for (int64_t j = j0; j <= p;) {  // page by page: rows j .. end of the page or p
      int64_t page = tp[b * W + j / ps];
      if (page < 0 || page >= P1) page = P1 - 1;
      const int64_t r0 = j % ps, rows = std::min<int64_t>(ps - r0, p + 1 - j);
      const float* ks = kp + head + (page * ps + r0) * H;
      const float* vs = vp + head + (page * ps + r0) * H;
      const int64_t at = j - j0;
      std::copy(vs, vs + rows * H, values.data() + at * H);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < H; ++h) keys[h * n + at + r] = ks[r * H + h];
      j += rows;
    }
    attend_group(qp + t * G * H, keys.data(), values.data(), o, G, H, n, 0, n, scores.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetservePagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetserveDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window"));
