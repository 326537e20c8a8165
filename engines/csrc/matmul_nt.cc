// y[M, N] = x[M, K] . w[N, K]^T in float32: the dense layers of a decode step on the CPU.
//
// Why: XLA's CPU backend sends every f32 dot to YNNPACK, which is slow at the 1-32 rows of
// a decode step. engines/cpu_kernels.py builds this file, registers it as the XLA FFI
// target "jetserve_matmul_nt" and decides when the model uses it (engines/model.py
// linear()). Two forms, both register tiles (AVX2 + FMA, and AVX-512 where the compiler
// targets it: the build is -march=native), output columns split over XLA's intra-op thread
// pool:
//  - under 8 rows, "dot" tiles of up to 3 rows of x by 4 rows of w, vectors along K and one
//    horizontal sum per output: each weight row is streamed once for all rows of x;
//  - from 8 rows on, x is first packed transposed into blocks xt[K][16] (a last block of
//    <= 8 rows 8 wide, zero padded), and a tile broadcasts one weight of each of 6 rows of
//    w per k against the block's one or two vectors of x: 12 FMAs per 2 loads and 6
//    broadcasts, no horizontal sums (at 16-32 rows the step is bound by the FMAs). With
//    AVX-512 the tile is 12 rows of w against two 16-row blocks, one 16-float vector each:
//    24 FMAs per 2 loads and 12 broadcasts. The weight rows meet every block of x in turn,
//    so they come from memory once; the packed copy (128 KiB at 32 rows of 1024) stays in
//    L2. Software prefetch of the weight rows made these tiles slower here.
//
// Layout: x, w and y are row-major and dense. Any M, N, K (tails of K below 8 and of N
// below the tile width take narrower tiles or scalar paths). Operands: x, an i32[] `layer`,
// then one or more weights, each a stack [L, N_j, K] read at that layer, with one result
// [M, N_j] each. Several weights in one call are the projections that read the same x (q, k
// and v; gate and up): x is packed once and their column chunks are shared out over the
// threads together, one parallel section where separate calls made one each. A scanned
// decoder (engines/layer_scan.py) passes its stacked weights whole with the layer's index,
// so the kernel reads that layer in place where a slice would make XLA copy the layer's
// weights out first; a plain call passes [1, N, K] and 0. An index outside [0, L) is an
// error, never a read out of bounds.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "parallel.h"
#include "simd_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
constexpr int kRows = 3;         // rows of x per register tile
constexpr int64_t kSmallM = 4;   // below this many rows, no blocking along K
constexpr int64_t kBlockK = 1024;  // K block that keeps the tile's rows of x in L1
// From this many rows on, x is packed and the packed tiles below run instead.
constexpr int64_t kPackedMinRows = 8;
constexpr int kPackedRows = 16;  // rows of x per packed block
// Rows of w per packed tile. With AVX-512 (32 vector registers, 16 floats each) a tile is
// 12 rows of w against one or two 16-row blocks of x: up to 24 accumulators, one
// broadcast per weight; with AVX2 (16 registers, 8 floats) 6 rows against one block.
#ifdef __AVX512F__
constexpr int kPackedCols = 12;
#else
constexpr int kPackedCols = 6;
#endif

#ifdef __AVX512F__
// The two 8-float halves of a added.
inline __m256 fold(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#endif

inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_hadd_ps(a, b);
  __m256 cd = _mm256_hadd_ps(c, d);
  __m256 s = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// y[r, 0:4] (+)= x[r, k0:k1] . w[0:4, k0:k1] for r < R.
template <int R>
inline void tile4(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                  int64_t ldy, int64_t k0, int64_t k1, bool acc_in) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t k = k0;
#ifdef __AVX512F__
  if (k + 16 <= k1) {  // 16 k at a time, the halves folded into the 8-wide sums after
    __m512 acc16[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc16[r][j] = _mm512_setzero_ps();
    for (; k + 16 <= k1; k += 16) {
      __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + ldw + k);
      __m512 w2 = _mm512_loadu_ps(w + 2 * ldw + k), w3 = _mm512_loadu_ps(w + 3 * ldw + k);
      for (int r = 0; r < R; ++r) {
        __m512 xr = _mm512_loadu_ps(x + r * ldx + k);
        acc16[r][0] = _mm512_fmadd_ps(xr, w0, acc16[r][0]);
        acc16[r][1] = _mm512_fmadd_ps(xr, w1, acc16[r][1]);
        acc16[r][2] = _mm512_fmadd_ps(xr, w2, acc16[r][2]);
        acc16[r][3] = _mm512_fmadd_ps(xr, w3, acc16[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = fold(acc16[r][j]);
  }
#endif
  for (; k + 8 <= k1; k += 8) {
    __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + ldw + k);
    __m256 w2 = _mm256_loadu_ps(w + 2 * ldw + k), w3 = _mm256_loadu_ps(w + 3 * ldw + k);
    for (int r = 0; r < R; ++r) {
      __m256 xr = _mm256_loadu_ps(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xr, w2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(xr, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float t[4];
    _mm_store_ps(t, hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    for (int64_t kk = k; kk < k1; ++kk)
      for (int j = 0; j < 4; ++j) t[j] += x[r * ldx + kk] * w[j * ldw + kk];
    float* yr = y + r * ldy;
    for (int j = 0; j < 4; ++j) yr[j] = acc_in ? yr[j] + t[j] : t[j];
  }
}

// y[r, 0] (+)= x[r, k0:k1] . w[0, k0:k1] for r < R (the last N % 4 columns).
template <int R>
inline void tile1(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy,
                  int64_t k0, int64_t k1, bool acc_in) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k = k0;
#ifdef __AVX512F__
  if (k + 16 <= k1) {
    __m512 acc16[R];
    for (int r = 0; r < R; ++r) acc16[r] = _mm512_setzero_ps();
    for (; k + 16 <= k1; k += 16) {
      __m512 w0 = _mm512_loadu_ps(w + k);
      for (int r = 0; r < R; ++r)
        acc16[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k), w0, acc16[r]);
    }
    for (int r = 0; r < R; ++r) acc[r] = fold(acc16[r]);
  }
#endif
  for (; k + 8 <= k1; k += 8) {
    __m256 w0 = _mm256_loadu_ps(w + k);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k), w0, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float t = jetserve::hsum(acc[r]);
    for (int64_t kk = k; kk < k1; ++kk) t += x[r * ldx + kk] * w[kk];
    y[r * ldy] = acc_in ? y[r * ldy] + t : t;
  }
}

// R rows of x against output columns [n, n + nw), nw <= 4.
template <int R>
void rows_block(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n,
                int64_t nw, int64_t k0, int64_t k1, bool acc_in) {
  if (nw == 4) {
    tile4<R>(x, K, w + n * K, K, y + n, N, k0, k1, acc_in);
  } else {
    for (int64_t j = 0; j < nw; ++j) tile1<R>(x, K, w + (n + j) * K, y + n + j, N, k0, k1, acc_in);
  }
}

// Every row of x against output columns [n, n + nw).
void all_rows(const float* x, int64_t K, const float* w, float* y, int64_t M, int64_t N,
              int64_t n, int64_t nw, int64_t k0, int64_t k1, bool acc_in) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    rows_block<kRows>(x + m * K, K, w, y + m * N, N, n, nw, k0, k1, acc_in);
  static_assert(kRows == 3, "the row tail below handles 1 or 2 rows");
  switch (M - m) {
    case 1: rows_block<1>(x + m * K, K, w, y + m * N, N, n, nw, k0, k1, acc_in); break;
    case 2: rows_block<2>(x + m * K, K, w, y + m * N, N, n, nw, k0, k1, acc_in); break;
    default: break;
  }
}

// Output columns [n0, n1) of y.
void matmul_cols(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t n0, int64_t n1) {
  // A few rows read each weight row once whole; more rows go block by block along K so
  // their slices of x stay in cache while the tile walks the columns.
  const int64_t block = M < kSmallM ? std::max<int64_t>(K, 1) : kBlockK;
  for (int64_t k0 = 0; k0 < std::max<int64_t>(K, 1); k0 += block) {
    const int64_t k1 = std::min<int64_t>(K, k0 + block);
    for (int64_t n = n0; n < n1; n += 4)
      all_rows(x, K, w, y, M, N, n, std::min<int64_t>(4, n1 - n), k0, k1, k0 > 0);
  }
}

// Rows of x in block b of the packed copy: 16, except a last block of at most 8 rows,
// packed 8 wide.
inline int64_t block_width(int64_t M, int64_t m0) { return M - m0 <= 8 ? 8 : kPackedRows; }

template <int C, int V>
struct PackedAcc {
  __m256 a[C][V];
};

// One k step of a packed tile. Force-inlined with every loop unrolled, so the accumulators
// stay in registers.
template <int C, int V>
__attribute__((always_inline)) inline void packed_step(PackedAcc<C, V>& acc, const float* xt,
                                                       const float* w, int64_t K, int64_t k) {
  __m256 xv[V];
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) xv[v] = _mm256_load_ps(xt + k * 8 * V + 8 * v);
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const __m256 b = _mm256_broadcast_ss(w + c * K + k);
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc.a[c][v] = _mm256_fmadd_ps(xv[v], b, acc.a[c][v]);
  }
}

// out[c][m] = sum_k xt[k, m] w[c, k] for m < 8 V, c < C, from one packed block xt[K][8 V].
// Kept out of line and writing to a small buffer: inlined into the loops below, GCC shuffled
// the accumulators between registers and the tile ran ~15% slower.
template <int C, int V>
__attribute__((noinline)) void packed_tile(const float* xt, const float* w, int64_t K,
                                           float* out) {
  PackedAcc<C, V> acc;
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc.a[c][v] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) packed_step(acc, xt, w, K, k + t);
  }
  for (; k < K; ++k) packed_step(acc, xt, w, K, k);
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm256_store_ps(out + c * 8 * V + 8 * v, acc.a[c][v]);
}

#ifdef __AVX512F__
template <int C, int B>
struct PackedAcc512 {
  __m512 a[C][B];
};

// One k step of an AVX-512 packed tile over B full 16-row blocks, block b at xt + b ldb.
template <int C, int B>
__attribute__((always_inline)) inline void packed_step512(PackedAcc512<C, B>& acc,
                                                          const float* xt, int64_t ldb,
                                                          const float* w, int64_t K, int64_t k) {
  __m512 xv[B];
#pragma GCC unroll 2
  for (int b = 0; b < B; ++b) xv[b] = _mm512_load_ps(xt + b * ldb + k * 16);
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    const __m512 s = _mm512_set1_ps(w[c * K + k]);
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) acc.a[c][b] = _mm512_fmadd_ps(xv[b], s, acc.a[c][b]);
  }
}

// out[c][16 b + m] = sum_k xt_b[k, m] w[c, k] for B full 16-row blocks xt_b = xt + b ldb.
// Two blocks share each broadcast weight (24 FMAs per 12 broadcasts and 2 loads of x).
template <int C, int B>
__attribute__((noinline)) void packed_tile512(const float* xt, int64_t ldb, const float* w,
                                              int64_t K, float* out) {
  PackedAcc512<C, B> acc;
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) acc.a[c][b] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) packed_step512(acc, xt, ldb, w, K, k + t);
  }
  for (; k < K; ++k) packed_step512(acc, xt, ldb, w, K, k);
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) _mm512_store_ps(out + c * 16 * B + 16 * b, acc.a[c][b]);
}
#endif

// y[:, n:n + C] from C rows of w against every packed block of x, one block (AVX-512: two
// blocks) after the other, so the C weight rows come from memory once and from cache for
// the blocks after the first.
template <int C>
void packed_cols_tile(const float* xt, const float* w, float* y, int64_t M, int64_t N,
                      int64_t K, int64_t n) {
  alignas(64) float out[C * 2 * kPackedRows];
  for (int64_t m = 0; m < M;) {
    const int64_t width = block_width(M, m);
    int64_t rows = std::min<int64_t>(kPackedRows, M - m), stride = width;
#ifdef __AVX512F__
    if (width == kPackedRows && M - m > 2 * kPackedRows - 8) {  // two full blocks
      packed_tile512<C, 2>(xt + m * K, kPackedRows * K, w + n * K, K, out);
      rows = std::min<int64_t>(2 * kPackedRows, M - m), stride = 2 * kPackedRows;
    } else if (width == kPackedRows) {
      packed_tile512<C, 1>(xt + m * K, 0, w + n * K, K, out);
    } else {
      packed_tile<C, 1>(xt + m * K, w + n * K, K, out);
    }
#else
    if (width == 8) packed_tile<C, 1>(xt + m * K, w + n * K, K, out);
    else packed_tile<C, 2>(xt + m * K, w + n * K, K, out);
#endif
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < C; ++c) y[(m + r) * N + n + c] = out[c * stride + r];
    m += rows;
  }
}

// Columns [n0, n1) of y from the packed blocks of x.
void packed_cols(const float* xt, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kPackedCols <= n1; n += kPackedCols)
    packed_cols_tile<kPackedCols>(xt, w, y, M, N, K, n);
  // The last N % kPackedCols columns in tiles of 8 (AVX-512), 4, 2 and 1 rows of w (one row
  // at a time is 2 FMAs per k where the 6-row tile does 12; every layer of a Llama has such
  // a tail).
#ifdef __AVX512F__
  if (n + 8 <= n1) packed_cols_tile<8>(xt, w, y, M, N, K, n), n += 8;
#endif
  if (n + 4 <= n1) packed_cols_tile<4>(xt, w, y, M, N, K, n), n += 4;
  if (n + 2 <= n1) packed_cols_tile<2>(xt, w, y, M, N, K, n), n += 2;
  if (n < n1) packed_cols_tile<1>(xt, w, y, M, N, K, n);
}

// out[j] = (r[0][j], ..., r[7][j]): the 8 x 8 transpose of r.
inline void transpose8(const __m256 r[8], __m256 out[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then rows 4-7
    s[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    out[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}

// xt[k][r] = x[m0 + r, k] per block (zero past row M); block b starts at xt + 16 b K.
// Eight rows by eight k at a time through an in-register transpose: at 32 x 1024, 5 us
// where the element-by-element copy took 17-49 us, on one core while the other waited.
void pack(const float* x, int64_t M, int64_t K, float* xt) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t m0 = 0; m0 < M; m0 += kPackedRows) {
    const int64_t rows = std::min<int64_t>(kPackedRows, M - m0), width = block_width(M, m0);
    float* blk = xt + m0 * K;
    for (int64_t g = 0; g < width; g += 8) {  // groups of 8 rows of the block
      const float* src[8];
      for (int i = 0; i < 8; ++i) src[i] = g + i < rows ? x + (m0 + g + i) * K : nullptr;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        __m256 r[8], c[8];
        for (int i = 0; i < 8; ++i) r[i] = src[i] ? _mm256_loadu_ps(src[i] + k) : zero;
        transpose8(r, c);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(blk + (k + j) * width + g, c[j]);
      }
      for (; k < K; ++k)
        for (int i = 0; i < 8; ++i) blk[k * width + g + i] = src[i] ? src[i][k] : 0.f;
    }
  }
}

// One weight of a call and its result: y [M, N] = x . w^T, w one layer [N, K] of its stack.
struct Part {
  const float* w;
  float* y;
  int64_t N;
};

// The parts of a call from its operands, checked: every w a stack [L, N, K] holding layer
// i, every result [M, N]. Sets *error and returns {} when an operand does not agree.
std::vector<Part> parts_of(ffi::RemainingArgs ws, ffi::RemainingRets ys, int64_t M, int64_t K,
                           int64_t i, std::string* error) {
  std::vector<Part> parts;
  if (ws.size() == 0 || ws.size() != ys.size()) {
    *error = "expected as many results as weights, at least one";
    return {};
  }
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(j);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (!w.has_value() || !y.has_value()) {
      *error = "weight " + std::to_string(j) + " or its result is not a float32 array";
      return {};
    }
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 3 || yd.size() != 2 || wd[2] != K || yd[0] != M || yd[1] != wd[1]) {
      *error = "weight " + std::to_string(j) + ": expected w [L, N, K] and result [M, N]";
      return {};
    }
    if (i < 0 || i >= wd[0]) {
      *error = "layer " + std::to_string(i) + " is outside [0, " + std::to_string(wd[0]) + ")";
      return {};
    }
    parts.push_back({w->typed_data() + i * wd[1] * K, (*y)->typed_data(), wd[1]});
  }
  return parts;
}

// A task: output columns [n0, n1) of part j.
struct Task {
  int64_t j, n0, n1;
};

// The column chunks of every part, a multiple of the tile width `align` each, several per
// thread so a late or interrupted thread still gets its share; the chunks of one call
// (q, k and v, or gate and up) are shared out together, so a small part never waits
// alone on a thread at the end of its own call.
std::vector<Task> tasks_of(const std::vector<Part>& parts, int64_t M, int64_t K,
                           int64_t threads, int64_t align, int64_t min_cols) {
  int64_t total = 0;
  for (const Part& p : parts) total += p.N;
  int64_t chunks = std::min<int64_t>(threads * 8, std::max<int64_t>(1, total / min_cols));
  if (threads == 1 || M * total * K < (1 << 18)) chunks = 1;
  const int64_t per = ((total + chunks - 1) / chunks + align - 1) / align * align;
  std::vector<Task> tasks;
  for (int64_t j = 0; j < static_cast<int64_t>(parts.size()); ++j)
    for (int64_t n0 = 0; n0 < parts[j].N; n0 += per)
      tasks.push_back({j, n0, std::min(parts[j].N, n0 + per)});
  return tasks;
}

// y_j = x . w_j^T for each weight w_j (a stack [L, N_j, K] read at layer i) and result
// y_j [M, N_j]: the projections that read the same x (q, k and v; gate and up) in one call,
// x packed once and their columns shared out over the threads together.
ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                    ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "jetserve_matmul_nt: expected x [M, K], layer i32[], then weights [L, N, K] and "
        "results [M, N]");
  const int64_t M = xd[0], K = xd[1];
  std::string error;
  const std::vector<Part> parts = parts_of(ws, ys, M, K, layer.typed_data()[0], &error);
  if (parts.empty()) return ffi::Error::InvalidArgument("jetserve_matmul_nt: " + error);
  if (M == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const int64_t threads = std::clamp<int64_t>(pool.num_threads(), 1, jetserve::kMaxThreads);
  const bool packed = M >= kPackedMinRows;
  // The packed copy of x lives as long as any task that may still read it. 64-byte aligned,
  // so each k step's one or two vectors of a block share one cache line.
  std::shared_ptr<float> xt;
  if (packed) {
    const int64_t floats = (M + kPackedRows - 1) / kPackedRows * kPackedRows * K;
    xt.reset(static_cast<float*>(std::aligned_alloc(64, sizeof(float) * floats)), std::free);
    if (!xt) return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                               "jetserve_matmul_nt: out of memory packing x");
    pack(xp, M, K, xt.get());
  }
  // A packed tile's 6 columns are 12 M K FLOPs, so its chunks can be a few tiles: at N / 64
  // chunks a [256, K] layer made 4 chunks of 11 tiles, too coarse to share between two
  // threads that start at different times.
  auto tasks = std::make_shared<const std::vector<Task>>(
      tasks_of(parts, M, K, threads, packed ? kPackedCols : 4, packed ? 2 * kPackedCols : 64));
  auto shared_parts = std::make_shared<const std::vector<Part>>(parts);
  jetserve::parallel_for(pool, tasks->size(), [=](int64_t t) {
    const Task& task = (*tasks)[t];
    const Part& p = (*shared_parts)[task.j];
    if (packed) {
      packed_cols(xt.get(), p.w, p.y, M, p.N, K, task.n0, task.n1);
    } else {
      matmul_cols(xp, p.w, p.y, M, p.N, K, task.n0, task.n1);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetserveMatmulNT, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
