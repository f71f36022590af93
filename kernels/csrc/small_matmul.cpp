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
// x [B, M, K] (fp32 or bf16, M <= 4), w [B, N, K] / [B, K, N] (fp32 or bf16; each matrix's rows
// contiguous, any stride between batches); out [B, M, N] in x's dtype. A row's sums do not
// depend on the other rows, nor on how the work is split between threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

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

at::Tensor dense_matvec(const at::Tensor& x, const at::Tensor& w) { return small_matmul(x, w, false); }
at::Tensor dense_vecmat(const at::Tensor& x, const at::Tensor& w) { return small_matmul(x, w, true); }

}  // namespace

}  // namespace triollm_cpu

TORCH_LIBRARY_FRAGMENT(triollm_cpu, m) {
  m.def("dense_matvec(Tensor x, Tensor w) -> Tensor");
  m.def("dense_vecmat(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(triollm_cpu, CPU, m) {
  m.impl("dense_matvec", &triollm_cpu::dense_matvec);
  m.impl("dense_vecmat", &triollm_cpu::dense_vecmat);
}
