// Products of a few rows (decode: 1-4 tokens) with dense weights that oneDNN has not packed: a
// MoE expert's slice of the stacked expert weights, DeepSeek's per-head absorbed projections
// (W_UK, W_UV, read in place from kv_b_proj's weight). torch sends these to an unpacked GEMM
// that reads bf16 weights at about half the memory's pace at one row, and `bmm` over a
// strided per-head view first copies the weight. Here the weights stream once, in place, in
// fp32 arithmetic (bf16 widened exactly): the pace of memory.
//
//   matvec: out[b, m, n] = sum_k x[b, m, k] * w[b, n, k]   (a linear's weight [N, K])
//   vecmat: out[b, m, n] = sum_k x[b, m, k] * w[b, k, n]   (a weight [K, N])
//
// blocked_matvec: the same product with a linear's weight as oneDNN packed it at load (read in
// place; engine/execution/layers/linear.py `BlockedWeight` finds and checks the layout): 64
// output rows a block, the block's k-th 64 weights contiguous (fp32: w[b][k][i] = W[64b+i][k];
// bf16, in pairs along k: w[b][k/2][i][k%2]), K padded to kp with zeros, N to a multiple of 64;
// or, kp = 0, the rows as they are (a one-row weight: oneDNN leaves it so).
// One row of weights feeds 64 accumulators per input row, with no sums across lanes at the end;
// oneDNN's own call, built for larger batches, ran at 0.4-0.9x this one's pace for 1-4 rows.
//
// x [B, M, K] (fp32 or bf16, M <= 4), w [B, N, K] / [B, K, N] (fp32 or bf16; each matrix's rows
// contiguous, any stride between batches); out [B, M, N] in x's dtype. A row's sums do not
// depend on the other rows, nor on how the work is split between threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_kernels.h"

// Not -ffast-math here: it lets the compiler split a row's sum over k into partial sums its own
// way in each instance (rows 1-4), and a row's bits would then depend on the rows beside it.
#pragma GCC optimize("no-fast-math")

namespace triollm_cpu {

namespace {

constexpr int64_t kMaxRows = 4;

// A weight as fp32: bf16 (its bits, as uint16_t) widened by hand, since c10's conversion is not
// inlined into functions compiled with other options (the pragma above).
inline float wf(float v) { return v; }
inline float wf(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// kR weight rows x kM input rows, k in 16-wide lanes (then a scalar tail): kR * kM independent
// vector accumulators.
template <typename W, int kM, int kR>
inline void matvec_rows(const float* x, int64_t K, const W* w, int64_t ldw, float* out, int64_t ldo) {
  float acc[kM][kR][16] = {};
  const int64_t k16 = K / 16 * 16;
  for (int64_t k = 0; k < k16; k += 16)
    for (int r = 0; r < kR; ++r) {
      const W* wr = w + r * ldw + k;
      // The next rows' lines, requested a group ahead: each row is a short stream (2 KB for
      // K = 1,024 in bf16), too short for the hardware prefetcher to be ahead of it.
      __builtin_prefetch(wr + kR * ldw, 0, 0);
      float wv[16];
#pragma omp simd
      for (int i = 0; i < 16; ++i) wv[i] = wf(wr[i]);
      for (int m = 0; m < kM; ++m)
#pragma omp simd
        for (int i = 0; i < 16; ++i) acc[m][r][i] += x[m * K + k + i] * wv[i];
    }
  for (int m = 0; m < kM; ++m)
    for (int r = 0; r < kR; ++r) {
      float s = 0.f;
      for (int i = 0; i < 16; ++i) s += acc[m][r][i];
      for (int64_t k = k16; k < K; ++k) s += x[m * K + k] * wf(w[r * ldw + k]);
      out[m * ldo + r] = s;
    }
}

template <typename W, int kM>
void matvec_range(const float* x, int64_t K, const W* w, int64_t n0, int64_t n1, float* out, int64_t N) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) matvec_rows<W, kM, 4>(x, K, w + n * K, K, out + n, N);
  for (; n < n1; ++n) matvec_rows<W, kM, 1>(x, K, w + n * K, K, out + n, N);
}

// Columns n0..n1 (a multiple of 16 wide, but for the last chunk) of x @ w: kM rows x 64 columns
// of accumulators, w's rows streamed k by k.
template <typename W, int kM>
void vecmat_range(const float* x, int64_t K, const W* w, int64_t N, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t kC = 64;
  for (int64_t c = n0; c < n1; c += kC) {
    const int64_t width = std::min(kC, n1 - c);
    float acc[kM][kC] = {};
    if (width == kC) {
      for (int64_t k = 0; k < K; ++k) {
        const W* wr = w + k * N + c;
        float wv[kC];
#pragma omp simd
        for (int i = 0; i < kC; ++i) wv[i] = wf(wr[i]);
        for (int m = 0; m < kM; ++m) {
          const float xv = x[m * K + k];
#pragma omp simd
          for (int i = 0; i < kC; ++i) acc[m][i] += xv * wv[i];
        }
      }
    } else {
      for (int64_t k = 0; k < K; ++k)
        for (int m = 0; m < kM; ++m) {
          const float xv = x[m * K + k];
          for (int64_t i = 0; i < width; ++i) acc[m][i] += xv * wf(w[k * N + c + i]);
        }
    }
    for (int m = 0; m < kM; ++m)
      for (int64_t i = 0; i < width; ++i) out[m * N + c + i] = acc[m][i];
  }
}

constexpr int64_t kBlock = 64;  // output rows a block of oneDNN's packed layout

// fp32 -> bf16 bits, rounded to nearest even (torch's cast); a NaN stays a (quiet) NaN.
inline uint16_t to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// One block's 64 outputs for kM rows of x: acc[m][i] += x[m][k] * w[k][i], k in order.
template <int kM>
void blocked_rows(const float* x, int64_t K, const float* w, float* out) {
#if defined(__AVX512F__)
  __m512 acc[kM][4];
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wr = w + k * kBlock;
    const __m512 w0 = _mm512_loadu_ps(wr), w1 = _mm512_loadu_ps(wr + 16), w2 = _mm512_loadu_ps(wr + 32),
                 w3 = _mm512_loadu_ps(wr + 48);
    for (int m = 0; m < kM; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xv, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + m * kBlock + 16 * j, acc[m][j]);
#else
  float acc[kM][kBlock] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* wr = w + k * kBlock;
    for (int m = 0; m < kM; ++m) {
      const float xv = x[m * K + k];
#pragma omp simd
      for (int i = 0; i < kBlock; ++i) acc[m][i] = __builtin_fmaf(xv, wr[i], acc[m][i]);
    }
  }
  std::memcpy(out, acc, sizeof acc);
#endif
}

// The bf16 pairs: acc[m][i] += x[m][2p] * w[p][i][0] + x[m][2p+1] * w[p][i][1] (VDPBF16PS where
// the CPU has it; a K that is odd pairs its last input with the padding's zero).
template <int kM>
void blocked_rows(const uint16_t* x, int64_t K, const uint16_t* w, float* out) {
  const int64_t pairs = K / 2;
  uint32_t last[kM];  // the odd K's last pair, (x, 0)
  for (int m = 0; m < kM; ++m) last[m] = K % 2 ? x[m * K + K - 1] : 0;
#if defined(__AVX512BF16__)
  __m512 acc[kM][4];
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs + K % 2; ++p) {
    const uint16_t* wr = w + p * 2 * kBlock;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr), w1 = (__m512bh)_mm512_loadu_si512(wr + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wr + 64), w3 = (__m512bh)_mm512_loadu_si512(wr + 96);
    for (int m = 0; m < kM; ++m) {
      uint32_t pair = last[m];
      if (p < pairs) std::memcpy(&pair, x + m * K + 2 * p, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xv, w2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xv, w3);
    }
  }
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + m * kBlock + 16 * j, acc[m][j]);
#else
  float acc[kM][kBlock] = {};
  for (int64_t p = 0; p < pairs + K % 2; ++p) {
    const uint16_t* wr = w + p * 2 * kBlock;
    for (int m = 0; m < kM; ++m) {
      const float x0 = wf(p < pairs ? x[m * K + 2 * p] : static_cast<uint16_t>(last[m]));
      const float x1 = p < pairs ? wf(x[m * K + 2 * p + 1]) : 0.f;
#pragma omp simd
      for (int i = 0; i < kBlock; ++i) acc[m][i] = __builtin_fmaf(x1, wf(wr[2 * i + 1]), __builtin_fmaf(x0, wf(wr[2 * i]), acc[m][i]));
    }
  }
  std::memcpy(out, acc, sizeof acc);
#endif
}

template <typename F>
void by_rows(int64_t M, F f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

at::Tensor small_matmul(const at::Tensor& x, const at::Tensor& w, bool transposed) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && x.size(0) == w.size(0), "small_matmul: x [B, M, K], w [B, ., .]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "small_matmul: x fp32 or bf16");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "small_matmul: w fp32 or bf16");
  const int64_t B = x.size(0), M = x.size(1), K = x.size(2);
  const int64_t N = transposed ? w.size(2) : w.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "small_matmul: 1 to 4 rows");
  TORCH_CHECK((transposed ? w.size(1) : w.size(2)) == K, "small_matmul: x's and w's inner sizes differ");
  TORCH_CHECK(w.stride(2) == 1 && w.stride(1) == w.size(2), "small_matmul: each matrix of w row-contiguous");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({B, M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t wstride = w.stride(0);
  // Tasks: (batch, a slice of N); about 16 KB of weights or more each.
  const int64_t per_row = K * static_cast<int64_t>(w.element_size());
  const int64_t chunk = std::max<int64_t>(64, ((16384 + per_row - 1) / per_row + 63) / 64 * 64);
  const int64_t slices = (N + chunk - 1) / chunk;
  auto run = [&](auto wtag) {
    using W = decltype(wtag);
    const W* wp = reinterpret_cast<const W*>(w.data_ptr());
    by_rows(M, [&](auto mtag) {
      constexpr int kM = decltype(mtag)::value;
      at::parallel_for(0, B * slices, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t b = t / slices, n0 = (t % slices) * chunk, n1 = std::min(N, n0 + chunk);
          const float* xb = xp + b * M * K;
          float* ob = op + b * M * N;
          if (transposed) {
            vecmat_range<W, kM>(xb, K, wp + b * wstride, N, n0, n1, ob);
          } else {
            matvec_range<W, kM>(xb, K, wp + b * wstride, n0, n1, ob, N);
          }
        }
      });
    });
  };
  if (w.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(uint16_t{});  // bf16's bits
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

// x [M, K] (M <= 4) and w (1-D, the packed buffer) of one dtype, fp32 or bf16; n, kp: the
// weight's output rows and padded input width; bias [n] of any float dtype or none. The result
// [M, n] in x's dtype, or fp32 where `fp32_out` (the load-time check of the layout compares it
// with a reference before rounding).
at::Tensor blocked_matvec(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t kp,
                          const std::optional<at::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.is_contiguous(), "blocked_matvec: x [M, K], w the packed buffer");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "blocked_matvec: x and w both fp32 or both bf16");
  const int64_t M = x.size(0), K = x.size(1), nb = (n + kBlock - 1) / kBlock;
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "blocked_matvec: 1 to 4 rows");
  TORCH_CHECK(kp == 0 ? w.numel() == n * K
                      : kp >= K + (bf16 ? K % 2 : 0) && (!bf16 || kp % 2 == 0) && w.numel() == nb * kp * kBlock,
              "blocked_matvec: w holds ceil(n / 64) blocks of kp x 64 weights, kp >= K (or, kp = 0, n rows of K)");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), "blocked_matvec: bias [n]");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = kp == 0 || !bf16 || fp32_out ? at::empty({M, n}, x.options().dtype(at::kFloat)) : at::Tensor();
  float* op = out.defined() ? out.data_ptr<float>() : nullptr;
  const at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  if (kp == 0) {  // rows as they are (oneDNN leaves a one-row weight so)
    const at::Tensor xf = xc.to(at::kFloat);
    by_rows(M, [&](auto mtag) {
      constexpr int kM = decltype(mtag)::value;
      at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
        if (bf16) {
          matvec_range<uint16_t, kM>(xf.data_ptr<float>(), K, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                                     n0, n1, op, n);
        } else {
          matvec_range<float, kM>(xf.data_ptr<float>(), K, w.data_ptr<float>(), n0, n1, op, n);
        }
      });
    });
    if (bp) out.add_(bf);
    return fp32_out || x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
  // bf16 out: each sum rounded (to nearest even, as torch's cast) where it is stored, not in a
  // second pass over an fp32 copy (a call's fixed cost is a visible part of a small layer's).
  const bool round = bf16 && !fp32_out;
  at::Tensor rounded = round ? at::empty({M, n}, x.options()) : at::Tensor();
  uint16_t* rp = round ? reinterpret_cast<uint16_t*>(rounded.data_ptr<at::BFloat16>()) : nullptr;
  by_rows(M, [&](auto mtag) {
    constexpr int kM = decltype(mtag)::value;
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      float acc[kM * kBlock];
      for (int64_t b = b0; b < b1; ++b) {
        if (bf16) {
          blocked_rows<kM>(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K,
                           reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + b * kp * kBlock, acc);
        } else {
          blocked_rows<kM>(xc.data_ptr<float>(), K, w.data_ptr<float>() + b * kp * kBlock, acc);
        }
        const int64_t width = std::min(kBlock, n - b * kBlock);
        for (int m = 0; m < kM; ++m)
          for (int64_t i = 0; i < width; ++i) {
            const float v = acc[m * kBlock + i] + (bp ? bp[b * kBlock + i] : 0.f);
            if (round) {
              rp[m * n + b * kBlock + i] = to_bf16(v);
            } else {
              op[m * n + b * kBlock + i] = v;
            }
          }
      }
    });
  });
  return round ? rounded : out;
}

namespace {

at::Tensor dense_matvec(const at::Tensor& x, const at::Tensor& w) { return small_matmul(x, w, false); }
at::Tensor dense_vecmat(const at::Tensor& x, const at::Tensor& w) { return small_matmul(x, w, true); }

}  // namespace

}  // namespace triollm_cpu

TORCH_LIBRARY_FRAGMENT(triollm_cpu, m) {
  m.def("dense_matvec(Tensor x, Tensor w) -> Tensor");
  m.def("dense_vecmat(Tensor x, Tensor w) -> Tensor");
  m.def("blocked_matvec(Tensor x, Tensor w, int n, int kp, Tensor? bias, bool fp32_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(triollm_cpu, CPU, m) {
  m.impl("dense_matvec", &triollm_cpu::dense_matvec);
  m.impl("dense_vecmat", &triollm_cpu::dense_vecmat);
  m.impl("blocked_matvec", &triollm_cpu::blocked_matvec);
}
