// A Llama decoder stack over quantized weights for an all-decode step, in one call.
//
// Batch-1 decode of a small quantized model is ~120 quantized linears and ~250 other ops per
// token, each a few microseconds of work; called one by one from Python, the calls cost as much
// as the work for SmolLM2-135M (docs/benchmarks.md). This runs the same kernels in the same
// order as LlamaDecoderLayer.forward's native path (engine/execution/models/llama.py), with
// nothing between them, so its results are the same bits:
//   h = x + o_proj(attention(rotary(qkv_proj(rms_norm(x)))));  x = h + down(silu_mul(gate_up(rms_norm(h))))
// It covers what an all-decode step of a quantized model needs and nothing more: fp32
// activations, the four projections quantized (kernels/quant.py's packed layout), no biases,
// no tensor parallelism; the model checks that before it calls (LlamaForCausalLM.decode_stack).

#include <torch/library.h>

#include "cpu_kernels.h"

namespace triollm_cpu {

// x [B, hidden] fp32, the B decode tokens' embeddings; per layer, `weights` holds 14 tensors:
// the input and post-attention norm weights, then (qp, dp, mp) of qkv_proj, o_proj,
// gate_up_proj and down_proj; `shapes` holds 8 ints: (bits, out_features) of the same four.
// k_caches/v_caches: each layer's cache; cos/sin [B, head_dim] (sin signed, as rotary_write_kv
// takes it); slots [B]; block_tables [B, max_blocks] and context_lens [B] as the paged decode
// attention takes them. Returns the residual stream after the last layer (before the final norm).
at::Tensor quant_decoder_stack(const at::Tensor& x, at::TensorList weights, at::IntArrayRef shapes,
                               at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                               double eps, double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_decoder_stack: x must be [B, hidden] float32");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 14 * L && static_cast<int64_t>(shapes.size()) == 8 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "quant_decoder_stack: per layer 14 weights, 8 shape ints and one K and V cache");
  const int64_t B = x.size(0), D = v_caches.empty() ? 0 : v_caches[0].size(3);
  at::Tensor h = x;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + 14 * i;
    const int64_t* s = shapes.data() + 8 * i;
    auto linear = [&](const at::Tensor& in, int64_t p) {  // projection p: 0 qkv, 1 o, 2 gate_up, 3 down
      return quant_linear_packed(in, w[2 + 3 * p], w[3 + 3 * p], w[4 + 3 * p], s[2 * p], s[2 * p + 1], "auto");
    };
    const at::Tensor qkv = linear(rms_norm(h, w[0], eps), 0);
    const at::Tensor q = rotary_write_kv(qkv, cos, sin, k_caches[i], v_caches[i], slots, num_heads, num_kv_heads);
    const at::Tensor attn = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, context_lens, scale);
    h = h + linear(attn.view({B, num_heads * D}), 1);
    h = h + linear(silu_and_mul(linear(rms_norm(h, w[1], eps), 2)), 3);
  }
  return h;
}

}  // namespace triollm_cpu

TORCH_LIBRARY_FRAGMENT(triollm_cpu, m) {
  m.def("quant_decoder_stack(Tensor x, Tensor[] weights, int[] shapes, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(triollm_cpu, CPU, m) { m.impl("quant_decoder_stack", &triollm_cpu::quant_decoder_stack); }
