// The reductions over a decode step's logits f32[B, V] in float32: the greedy token and the
// log-probs of each slot, on the CPU.
//
// Why: after the LM head, XLA's CPU backend spent ~5 ms of a 32-slot step of a 32000-token
// vocabulary here: jnp.argmax as a generic (value, index) reduction (1.2 ms), the
// log-softmax (0.9 ms) and lax.top_k over the log-probs (3.1 ms). Here each row is read from
// L2 a few times in 8-lane vectors. engines/cpu_kernels.py builds this file and registers
// the targets; engines.sampling uses them when the engine has the CPU kernels on.
//
//  - "jetserve_argmax": logits [B, V] -> s32[B], the first index of each row's largest
//    value, a NaN counting above everything (as jnp.argmax).
//  - "jetserve_log_probs": logits [B, V], tokens s32[B] -> the log-softmax of each row at
//    its token (f32[B]; NaN for a token outside [0, V)), the row's n best log-probs and
//    their ids (f32[B, n], s32[B, n]; best first, the lower id first among equals, as
//    lax.top_k), and ok s32[B]: 0 where the row holds a NaN or an infinite maximum, for
//    which the caller takes XLA's result instead (this kernel does not mimic XLA's NaN
//    orderings).
//
// The log-softmax is (x - max) - log(sum exp(x - max)), as jax.nn.log_softmax; exp comes
// from jetserve::exp_nonpositive (relative error < 2e-7) and the sum runs in another order
// (partly in double), so the log-probs agree with XLA's to about 1e-6.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "simd_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The largest value of a row, NaNs aside; *nan tells whether it holds one.
float row_max(const float* x, int64_t V, bool* nan) {
  __m256 vmax = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    vmax = _mm256_max_ps(v, vmax);  // a NaN lane of v keeps vmax
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float m = jetserve::hmax(vmax);
  *nan = _mm256_movemask_ps(unordered) != 0;
  for (; j < V; ++j) {
    if (std::isnan(x[j])) *nan = true;
    else m = std::max(m, x[j]);
  }
  return m;
}

int32_t row_argmax(const float* x, int64_t V) {
  bool nan;
  const float m = row_max(x, V, &nan);
  if (nan) return static_cast<int32_t>(std::find_if(x, x + V, [](float v) { return std::isnan(v); }) - x);
  const __m256 vm = _mm256_set1_ps(m);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), vm, _CMP_EQ_OQ));
    if (mask) return static_cast<int32_t>(j + __builtin_ctz(mask));
  }
  for (; j < V; ++j)
    if (x[j] == m) return static_cast<int32_t>(j);
  return 0;  // V == 0
}

// The n best (log-prob, id) of a row so far, best first; among equals the lower id first.
class Best {
 public:
  Best(float* lp, int32_t* ids, int64_t n) : lp_(lp), ids_(ids), n_(n) {}
  // The bar a later id must clear (ids arrive in increasing order, so equal is not enough).
  float bar() const { return count_ < n_ ? -INFINITY : lp_[n_ - 1]; }
  bool full() const { return count_ == n_; }
  void offer(float v, int32_t id) {
    int64_t at;
    if (count_ < n_) {
      at = count_++;
    } else if (v > lp_[n_ - 1]) {
      at = n_ - 1;
    } else {
      return;
    }
    for (; at > 0 && lp_[at - 1] < v; --at) {
      lp_[at] = lp_[at - 1];
      ids_[at] = ids_[at - 1];
    }
    lp_[at] = v;
    ids_[at] = id;
  }

 private:
  float* lp_;
  int32_t* ids_;
  int64_t n_, count_ = 0;
};

// Row r's log-prob at its token and its n best; false where XLA must decide (see above).
bool row_log_probs(const float* x, int64_t V, int32_t token, int64_t n, float* chosen,
                   float* top_lp, int32_t* top_ids) {
  bool nan;
  const float m = row_max(x, V, &nan);
  if (nan || !std::isfinite(m)) return false;
  // Lanes sum blocks of 1024 entries; the blocks add up in double, so the sum's error
  // stays near one rounding rather than growing with the vocabulary.
  const __m256 vm = _mm256_set1_ps(m);
  __m256d total = _mm256_setzero_pd();
  int64_t j = 0;
  while (j + 8 <= V) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    const int64_t end = std::min<int64_t>(V, j + 1024);
    for (; j + 16 <= end; j += 16) {
      s0 = _mm256_add_ps(s0, jetserve::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
      s1 = _mm256_add_ps(s1, jetserve::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vm)));
    }
    for (; j + 8 <= end; j += 8)
      s0 = _mm256_add_ps(s0, jetserve::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
    const __m256 s = _mm256_add_ps(s0, s1);
    total = _mm256_add_pd(total, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1))));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, total);
  double dsum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; j < V; ++j) dsum += std::exp(x[j] - m);
  const float sum = static_cast<float>(dsum);
  const float lse = std::log(sum);
  auto log_prob = [=](int64_t i) { return (x[i] - m) - lse; };
  *chosen = 0 <= token && token < V ? log_prob(token) : kNaN;
  if (n == 0) return true;
  Best best(top_lp, top_ids, n);
  j = 0;
  for (; j < V && !best.full(); ++j) best.offer(log_prob(j), static_cast<int32_t>(j));
  const __m256 vlse = _mm256_set1_ps(lse);
  for (; j + 8 <= V; j += 8) {
    const __m256 lp = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vlse);
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(lp, _mm256_set1_ps(best.bar()), _CMP_GT_OQ));
    for (; mask; mask &= mask - 1) {
      const int lane = __builtin_ctz(mask);
      best.offer(log_prob(j + lane), static_cast<int32_t>(j + lane));
    }
  }
  for (; j < V; ++j) best.offer(log_prob(j), static_cast<int32_t>(j));
  return true;
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                  ffi::ResultBuffer<ffi::S32> out) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || out->dimensions().size() != 1 || out->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("jetserve_argmax expects logits [B, V] and result [B]");
  const int64_t V = d[1];
  const float* x = logits.typed_data();
  int32_t* o = out->typed_data();
  jetserve::parallel_for(pool, d[0], [=](int64_t r) { o[r] = row_argmax(x + r * V, V); });
  return ffi::Error::Success();
}

ffi::Error LogProbs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                    ffi::Buffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::F32> chosen,
                    ffi::ResultBuffer<ffi::S32> top_ids, ffi::ResultBuffer<ffi::F32> top_lp,
                    ffi::ResultBuffer<ffi::S32> ok) {
  const auto d = logits.dimensions(), ids_d = top_ids->dimensions();
  if (d.size() != 2 || tokens.dimensions().size() != 1 || tokens.dimensions()[0] != d[0] ||
      chosen->dimensions().size() != 1 || chosen->dimensions()[0] != d[0] ||
      ids_d.size() != 2 || ids_d[0] != d[0] || ids_d[1] > d[1] ||
      top_lp->dimensions().size() != 2 || top_lp->dimensions()[0] != d[0] ||
      top_lp->dimensions()[1] != ids_d[1] || ok->dimensions().size() != 1 ||
      ok->dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument(
        "jetserve_log_probs expects logits [B, V], tokens [B] and results [B], [B, n], "
        "[B, n], [B] with n <= V");
  const int64_t V = d[1], n = ids_d[1];
  const float* x = logits.typed_data();
  const int32_t* tok = tokens.typed_data();
  float* c = chosen->typed_data();
  int32_t* ids = top_ids->typed_data();
  float* lp = top_lp->typed_data();
  int32_t* good = ok->typed_data();
  jetserve::parallel_for(pool, d[0], [=](int64_t r) {
    good[r] = row_log_probs(x + r * V, V, tok[r], n, c + r, lp + r * n, ids + r * n);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetserveArgmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetserveLogProbs, LogProbs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
