// y[M, N] = x[M, K] . w[N, K]^T in float32: the dense layers of a decode step on the CPU.
//
// Why: XLA's CPU backend sends every f32 dot to YNNPACK, which is slow at the 1-32 rows of
// a decode step, where the step is bound by reading the weights once. This kernel streams
// each weight row once for all rows of x (tiles of up to 3 rows of x by 4 rows of w, AVX2 +
// FMA) and splits the output columns over XLA's intra-op thread pool. engines/cpu_matmul.py
// builds it, registers it as the XLA FFI target "jetserve_matmul_nt" and decides when the
// model uses it (engines/model.py linear()).
//
// Layout: x, w and y are row-major and dense. Any M, N, K (tails of K below 8 and of N
// below 4 take scalar paths).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxThreads = 64;
constexpr int kRows = 3;         // rows of x per register tile
constexpr int64_t kSmallM = 4;   // below this many rows, no blocking along K
constexpr int64_t kBlockK = 1024;  // K block that keeps the tile's rows of x in L1

inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_hadd_ps(a, b);
  __m256 cd = _mm256_hadd_ps(c, d);
  __m256 s = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline float hsum1(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// y[r, 0:4] (+)= x[r, k0:k1] . w[0:4, k0:k1] for r < R.
template <int R>
inline void tile4(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                  int64_t ldy, int64_t k0, int64_t k1, bool acc_in) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t k = k0;
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
  for (; k + 8 <= k1; k += 8) {
    __m256 w0 = _mm256_loadu_ps(w + k);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k), w0, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float t = hsum1(acc[r]);
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

struct Progress {
  std::atomic<int64_t> next{0};  // the next column chunk to claim
  std::atomic<int64_t> done{0};  // chunks finished
};

ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] ||
      yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument(
        "jetserve_matmul_nt: expected x [M, K], w [N, K] and result [M, N]");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t threads = std::clamp<int64_t>(pool.num_threads(), 1, kMaxThreads);
  // Column chunks of a multiple of 4, a few per thread so a late thread still helps; the
  // calling thread takes chunks too, so the result never waits on a busy pool.
  int64_t chunks = std::min<int64_t>(threads * 4, std::max<int64_t>(1, N / 64));
  if (threads == 1 || M * N * K < (1 << 18)) chunks = 1;
  const int64_t per = ((N + chunks - 1) / chunks + 3) / 4 * 4;
  chunks = (N + per - 1) / per;
  auto progress = std::make_shared<Progress>();
  auto work = [=]() {
    int64_t c;
    while ((c = progress->next.fetch_add(1)) < chunks) {
      matmul_cols(xp, wp, yp, M, N, K, c * per, std::min<int64_t>(N, (c + 1) * per));
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(threads, chunks); ++t) pool.Schedule([work] { work(); });
  work();
  // Chunks other threads claimed: spin briefly, then give the core away (the machine may
  // have fewer cores free than the pool has threads).
  for (int spins = 0; progress->done.load(std::memory_order_acquire) < chunks; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetserveMatmulNT, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
