// The native CPU kernels' entry points, for the kernels that call each other across files
// (decoder.cpp runs a decoder stack from them). Each is also a torch op in the triollm_cpu
// namespace; their comments are at the definitions.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace triollm_cpu {

// The next task for the threads that take tasks as they come free: alone on its cache line, so
// that claiming one does not evict the line holding the task list and buffers the other thread
// is reading (each claim moved that line between the cores: ~0.2 us a task).
struct alignas(64) TaskCounter {
  std::atomic<int64_t> next{0};
  int64_t take() { return next.fetch_add(1, std::memory_order_relaxed); }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
// k_scale, v_scale: a quantized cache's scales (kernels/kv_quant.py), none for a plain cache.
at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                           int64_t num_heads, int64_t num_kv_heads,
                           const std::optional<at::Tensor>& k_scale = std::nullopt,
                           const std::optional<at::Tensor>& v_scale = std::nullopt);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t window = 0, double softcap = 0.0,  // 0: none
                                  const std::optional<at::Tensor>& k_scale = std::nullopt,
                                  const std::optional<at::Tensor>& v_scale = std::nullopt,
                                  const std::optional<at::Tensor>& sinks = std::nullopt,
                                  int64_t chunk = 0);  // sinks: float32 [H]; chunk 0: none
at::Tensor quant_linear_packed(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp,
                               const at::Tensor& mp, int64_t bits, int64_t N, const std::string& isa);
at::Tensor quant_linear_bf16(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                             int64_t bits, int64_t N);
at::Tensor blocked_matvec(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t kp,
                          const std::optional<at::Tensor>& bias, bool fp32_out);
at::Tensor quant_swiglu_bf16(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                             int64_t bits, int64_t N);

// The pieces decoder.cpp's team stack runs on threads it already holds (kernels called from a
// thread of a parallel region run their loops inline: at::parallel_for does not nest). fp32 rows.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t hidden, float eps);
void silu_and_mul_rows(const float* x, float* out, int64_t rows, int64_t inter);
// A packed weight's checks (quant_linear_packed's, for K inputs); whether quant_linear_packed(...,
// "auto") runs M rows by its vector paths (not AMX tiles); activations quantized as it quantizes
// them; and output groups [g0, g1) (16 outputs each, out [M, N]) as those paths compute them.
void check_packed_weight(const char* op, int64_t K, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                         int64_t bits, int64_t N);
bool packed_vector_path(int64_t M, int64_t bits, int64_t N);
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx);
void packed_groups_auto(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t bits, int64_t N, int64_t K,
                        int64_t M, const int8_t* qx, const float* dx, const float* sx, int64_t g0, int64_t g1,
                        float* out);

// One decode step's attention over every layer's cache, for a team of threads (decoder.cpp): the
// rows' tasks planned once (they depend on the rows' lengths only). Per layer: `write`, the new
// tokens' rotary and K/V (rotary_write_kv's work; one thread); `attend`, paged_decode_attention's
// tasks, taken by any number of threads until none are left; and, where rows are split
// (`split`), `merge`, share `share` of `shares`. The same kernels and order as those ops: the same bits.
class StepAttention {
 public:
  virtual ~StepAttention() = default;
  virtual void write(int64_t layer, const float* qkv, float* q) = 0;
  virtual void attend(int64_t layer, const float* q, float* out) = 0;
  virtual bool split() const = 0;
  virtual void merge(int64_t layer, float* out, int64_t share, int64_t shares) = 0;
};
// B fp32 rows (qkv [B, (H + 2 KVH) D]) over caches of one dtype (float32, bfloat16, fp8 or int8,
// with scales as rotary_write_kv takes them), no window, soft-cap or sinks; null where the
// arguments are not what the plain ops would take without a copy (the caller then runs them).
std::unique_ptr<StepAttention> step_attention(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                                              const at::Tensor& sin, const at::Tensor& slots,
                                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                                              int64_t B, int64_t num_heads, double scale, at::TensorList k_scales,
                                              at::TensorList v_scales);

}  // namespace triollm_cpu
