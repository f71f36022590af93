// The native CPU kernels' entry points, for the kernels that call each other across files
// (decoder.cpp runs a decoder stack from them). Each is also a torch op in the triollm_cpu
// namespace; their comments are at the definitions.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace triollm_cpu {

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

}  // namespace triollm_cpu
