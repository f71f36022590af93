// Random sampling's last step on CPU: one token per row of a distribution `probs` [B, V] (up to
// scale: the rows need not sum to 1) by inverse transform with the row's uniform u: the first
// token whose running sum of probabilities passes u * total, summed in double. One uniform a row
// where the exponential race (argmax p / q, q ~ Exp(1)) drew V of them: with torch's generator
// that draw was most of a sampled step's time at 49k-token vocabularies (docs/benchmarks.md).
//
// A token with probability 0 (masked by top-k, top-p, min-p or a grammar) is never chosen: its
// running sum equals its predecessor's, so it cannot be the first to pass. The rows' block sums
// (256 tokens, double) find the block the target falls in, and a sequential scan inside it finds
// the token; where rounding leaves the target past the scan's end, the row's last token with a
// positive probability is taken (u < 1 makes that a rounding case only).
//
// Greedy rows' argmax (`greedy_argmax`), torch.argmax's answer for fp32 [B, V]: the first index of
// the row's largest value, a NaN counting as the largest (the first NaN), -0.0 equal to +0.0.
// Compared as integer keys (the float's bits made monotonic), so -ffast-math cannot drop the NaN
// and infinity cases, and the compiler vectorises both passes: the largest key, then the first
// index holding it. torch's CPU argmax (a scalar loop with the index carried) took 2.9 ms of a
// 64-row step at SmolLM2's 49k-token vocabulary.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

namespace triollm_cpu {

namespace {

constexpr int64_t kSumBlock = 256;

int64_t sample_row(const float* p, int64_t V, double u, std::vector<double>& sums) {
  const int64_t nb = (V + kSumBlock - 1) / kSumBlock;
  sums.assign(nb, 0.0);
  double total = 0.0;
  for (int64_t k = 0; k < nb; ++k) {
    const int64_t hi = std::min(V, (k + 1) * kSumBlock);
    double s = 0.0;
    for (int64_t i = k * kSumBlock; i < hi; ++i) s += p[i] > 0.f ? static_cast<double>(p[i]) : 0.0;
    sums[k] = s;
    total += s;
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t k = 0;
  while (k + 1 < nb && acc + sums[k] <= target) acc += sums[k++];
  int64_t last = -1;
  for (int64_t i = k * kSumBlock; i < V; ++i) {
    if (!(p[i] > 0.f)) continue;
    last = i;
    acc += p[i];
    if (acc > target) return i;
  }
  for (int64_t i = V - 1; last < 0 && i >= 0; --i)
    if (p[i] > 0.f) last = i;
  return last < 0 ? 0 : last;  // no positive probability at all (NaN rows): token 0
}

// A key per float whose signed order is the floats' order (NaN above everything, -0.0 as 0.0).
// Branch-free, so both passes vectorise.
inline int32_t order_key(uint32_t bits) {
  const int32_t mag = static_cast<int32_t>(bits & 0x7fffffffu);
  const int32_t neg = -static_cast<int32_t>(bits >> 31);  // all ones for a negative sign
  const int32_t key = (mag ^ neg) - neg;                   // -mag where negative: -0.0 and +0.0 both 0
  return mag > 0x7f800000 ? INT32_MAX : key;               // NaN above everything
}

int64_t argmax_row(const uint32_t* x, int64_t V) {
  int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < V; ++i) best = std::max(best, order_key(x[i]));
  // The first index holding it, 16 at a time (the row is in cache from the first pass).
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    bool hit = false;
    for (int64_t j = 0; j < 16; ++j) hit |= order_key(x[i + j]) == best;
    if (hit) break;
  }
  for (; i < V; ++i)
    if (order_key(x[i]) == best) return i;
  return 0;
}

}  // namespace

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "greedy_argmax: logits must be [B, V] float32 with V > 0, got ", logits.sizes(), " ", logits.scalar_type());
  const at::Tensor lc = logits.contiguous();
  const int64_t B = lc.size(0), V = lc.size(1);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const auto* x = reinterpret_cast<const uint32_t*>(lc.data_ptr<float>());
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, V >= (1 << 14) ? 1 : B, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) op[b] = argmax_row(x + b * V, V);
  });
  return out;
}

at::Tensor sample_inverse_cdf(const at::Tensor& probs, const at::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat,
              "sample_inverse_cdf: probs must be [B, V] float32, got ", probs.sizes(), " ", probs.scalar_type());
  TORCH_CHECK(u.dim() == 1 && u.size(0) == probs.size(0) && u.scalar_type() == at::kDouble,
              "sample_inverse_cdf: u must be [B] float64");
  const at::Tensor pc = probs.contiguous(), uc = u.contiguous();
  const int64_t B = pc.size(0), V = pc.size(1);
  at::Tensor out = at::empty({B}, probs.options().dtype(at::kLong));
  const float* p = pc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, V >= (1 << 14) ? 1 : B, [&](int64_t b0, int64_t b1) {
    std::vector<double> sums;
    for (int64_t b = b0; b < b1; ++b) op[b] = sample_row(p + b * V, V, up[b], sums);
  });
  return out;
}

}  // namespace triollm_cpu

TORCH_LIBRARY_FRAGMENT(triollm_cpu, m) {
  m.def("sample_inverse_cdf(Tensor probs, Tensor u) -> Tensor");
  m.def("greedy_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(triollm_cpu, CPU, m) {
  m.impl("sample_inverse_cdf", &triollm_cpu::sample_inverse_cdf);
  m.impl("greedy_argmax", &triollm_cpu::greedy_argmax);
}
