// A Llama decoder stack over quantized weights for an all-decode step, in one call; and the
// LoRA update both it and the layer-by-layer path add to a projection's output.
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
//
// LoRA (lora/layers.py): `lora_apply` adds one adapter slot's update to some rows of a
// projection's output, out[rows] += (x[rows] A^T) B^T, A `[P*r, in]` and B^T `[P*r, out]` block-
// diagonal over the P pieces the projection stacks. For a few rows (decode) it is a loop of dot
// products and row updates that skip the pieces the adapter does not target and B's zero
// blocks: at::mm and addmm_ on such thin matrices cost several times their arithmetic. For more
// rows it is at::mm and addmm_ (BLAS wins there). Every output element is one thread's fixed
// loop, so the result does not depend on the grouping or the thread count, and the stack,
// calling the same function after each projection, gives the layer path's bits.

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_kernels.h"

namespace triollm_cpu {

namespace {

constexpr int64_t kLoopRows = 16;  // up to this many rows: the loops, else BLAS

// The slots' weights are float32 or bfloat16 (lora_dtype); activations are float32.
inline float to_float(float v) { return v; }
inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <typename W>
inline float dot(const W* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += to_float(a[i]) * b[i];
  return s;
}

// The few-rows path of lora_update (below): h = x A^T by dot products over A's rows, then each
// row's update accumulated over B^T's rows (contiguous, vectorised), only in each piece's own
// columns, and added to out.
template <typename W>
void lora_loops(const std::vector<const float*>& xr, const std::vector<float*>& outr, int64_t in, const W* A,
                int64_t lda, const W* Bt, int64_t ldb, const int64_t* bounds, int64_t P, int64_t r, int64_t mask) {
  const int64_t n = static_cast<int64_t>(xr.size()), k = P * r;
  std::vector<float> h(n * k, 0.f);  // h[j * k + c]: row j's shrunk input
  at::parallel_for(0, k, k * in * n < (1 << 16) ? k : 8, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      if (!((mask >> (c / r)) & 1)) continue;
      for (int64_t j = 0; j < n; ++j) h[j * k + c] = dot(A + c * lda, xr[j], in);
    }
  });
  const int64_t O = bounds[P];
  at::parallel_for(0, O, O * r * n < (1 << 16) ? O : 256, [&](int64_t o0, int64_t o1) {
    std::vector<float> delta(o1 - o0);
    float* __restrict d = delta.data();
    for (int64_t j = 0; j < n; ++j) {
      std::fill(delta.begin(), delta.end(), 0.f);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t lo = std::max(o0, bounds[p]), hi = std::min(o1, bounds[p + 1]);
        if (!((mask >> p) & 1) || lo >= hi) continue;
        for (int64_t t = 0; t < r; ++t) {
          const float hv = h[j * k + p * r + t];
          const W* __restrict brow = Bt + (p * r + t) * ldb;
          for (int64_t o = lo; o < hi; ++o) d[o - o0] += hv * to_float(brow[o]);
        }
      }
      float* __restrict dst = outr[j];
      for (int64_t o = o0; o < o1; ++o) dst[o] += d[o - o0];
    }
  });
}

// out[rows] += (x[rows] A^T) B^T for one slot: a [>= P*r, in] and bt [>= P*r, out] (B^T) the
// slot's buffers (rows past P*r unused), bounds[0..P] the pieces' output column boundaries, mask
// bit p set where piece p is targeted; rows: a long index, or (when empty) [start, start + n).
void lora_update(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                 const int64_t* bounds, int64_t P, int64_t r, int64_t mask, const at::Tensor& rows, int64_t start,
                 int64_t n) {
  const bool gathered = rows.numel() > 0;
  const int64_t k = P * r;
  if (n > kLoopRows) {
    const at::Tensor at_ = a.narrow(0, 0, k).t(), bt_ = bt.narrow(0, 0, k);
    const at::Tensor xs = gathered ? x.index_select(0, rows) : x.narrow(0, start, n);
    if (a.scalar_type() != at::kFloat) {
      // bfloat16 slots: the weights widened to fp32 (k x (in + out) values, against n x k x
      // (in + out) products), the matmuls in fp32 as the loops compute; a bf16 matmul on a CPU
      // without native bf16 is emulated, and was 50x slower at prefill sizes.
      const at::Tensor delta = at::mm(at::mm(xs, at_.to(at::kFloat)), bt_.to(at::kFloat));
      gathered ? out.index_add_(0, rows, delta) : out.narrow(0, start, n).add_(delta);
    } else if (gathered) {
      out.index_add_(0, rows, at::mm(at::mm(xs, at_), bt_));
    } else {
      out.narrow(0, start, n).addmm_(at::mm(xs, at_), bt_);
    }
    return;
  }
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && a.stride(1) == 1 && bt.stride(1) == 1,
              "lora_apply: rows must be contiguous");
  const int64_t* idx = gathered ? rows.data_ptr<int64_t>() : nullptr;
  std::vector<const float*> xr(n);
  std::vector<float*> outr(n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = gathered ? idx[j] : start + j;
    xr[j] = x.data_ptr<float>() + row * x.stride(0);
    outr[j] = out.data_ptr<float>() + row * out.stride(0);
  }
  const int64_t in = x.size(1), lda = a.stride(0), ldb = bt.stride(0);
  if (a.scalar_type() == at::kFloat) {
    lora_loops(xr, outr, in, a.data_ptr<float>(), lda, bt.data_ptr<float>(), ldb, bounds, P, r, mask);
  } else {
    const auto* A = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
    const auto* Bt = reinterpret_cast<const uint16_t*>(bt.data_ptr<at::BFloat16>());
    lora_loops(xr, outr, in, A, lda, Bt, ldb, bounds, P, r, mask);
  }
}

}  // namespace

// The op the layer path calls (lora/layers.py LoRALayer.apply): CPU tensors, fp32 activations,
// fp32 or bf16 slots, `out` updated in place.
void lora_apply(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, at::IntArrayRef bounds,
                int64_t rank, int64_t mask, const at::Tensor& rows, int64_t start, int64_t n) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                  bt.scalar_type() == a.scalar_type(),
              "lora_apply: float32 activations, float32 or bfloat16 weights");
  const int64_t P = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(P >= 1 && bounds[P] == out.size(1) && a.size(0) >= P * rank && bt.size(0) >= P * rank && bt.size(1) == out.size(1),
              "lora_apply: bounds, rank and buffers disagree");
  lora_update(out, x, a, bt, bounds.data(), P, rank, mask, rows, start, n);
}

// ------------------------------------------------------------------------------------------
// The stack on one team of threads. Called op by op, a batch-1 step of SmolLM2-135M is ~240
// parallel regions (each projection, attention, norm) and as many tensors allocated, a few
// microseconds each against ~20 us of weights a projection: on two cores the second thread waited
// for the first a third of the step (docs/benchmarks.md). Here the threads enter one region for
// the whole stack and meet at a barrier between the steps that need each other's results, as
// llama.cpp's graph runs. Each thread computes its share of a projection's output groups (the
// split the op's parallel_for makes, and no output depends on it) and adds the residual to those
// columns itself; the row-wise steps that are cheap (norms, SwiGLU, quantizing the activations)
// run on every thread into its own buffers rather than wait for one; rotary and the new K/V are
// one thread's; attention's tasks go to whichever thread is free, as in the op. The kernels are
// the ops' own, in the ops' order: the same bits as the op-by-op loop below, at any thread count.

// A barrier for a team that shares the work of `total` shares: a thread that holds several shares
// (a smaller team than asked for) arrives with all of them at once, so no thread waits for one
// that does not exist. It spins (a barrier between two steps of one layer lasts microseconds),
// then yields, so that a team with more threads than free cores still makes progress.
class TeamBarrier {
 public:
  explicit TeamBarrier(int64_t total) : total_(total) {}
  void wait(int64_t shares) {
    const int64_t g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(shares, std::memory_order_acq_rel) + shares == total_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(g + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == g; ++spins) {
      if (spins < kSpins) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 2048;  // ~35-75 us of `pause`: a healthy wait here is a few us
  alignas(64) std::atomic<int64_t> count_{0};
  alignas(64) std::atomic<int64_t> gen_{0};
  int64_t total_;
};

// Calls that ran on a team (tests check that the path they compare is the one taken).
std::atomic<int64_t> team_calls{0};
int64_t team_stack_calls() { return team_calls.load(); }

// One projection of a layer (its packed weight) as the team reads it.
struct TeamProj {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int64_t bits, N, K, G;
  int64_t threads;  // the shares that read it: as quant_linear_packed's grain allows (~32 KB a share)
};

// The team stack where it applies (no adapters, no tiles, every projection on the vector paths
// for B rows, a cache `step_attention` takes); an undefined tensor otherwise. Checks as the ops'.
at::Tensor team_stack(const at::Tensor& x, at::TensorList weights, at::IntArrayRef shapes, at::TensorList k_caches,
                      at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t H, int64_t KVH,
                      double eps, double scale, at::TensorList k_scales, at::TensorList v_scales) {
  const int64_t L = static_cast<int64_t>(k_caches.size()), B = x.size(0), hidden = x.size(1);
  if (L == 0 || B == 0 || !x.is_contiguous() || v_caches[0].dim() != 4 || v_caches[0].size(0) != KVH) return {};
  const int64_t D = v_caches[0].size(3), HD = H * D;
  std::unique_ptr<StepAttention> attention =
      step_attention(k_caches, v_caches, cos, sin, slots, block_tables, context_lens, B, H, scale, k_scales, v_scales);
  if (!attention) return {};
  // A team only under OpenMP, whose threads all run at once (a task pool may queue a share
  // behind one that waits for it); one thread where already inside a parallel region.
  const int64_t T = AT_PARALLEL_OPENMP && !at::in_parallel_region() ? std::max(1, at::get_num_threads()) : 1;
  std::vector<TeamProj> projs;
  projs.reserve(4 * L);
  int64_t kmax = std::max(hidden, HD), inter = 0;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + 14 * i;
    const int64_t* s = shapes.data() + 8 * i;
    for (int64_t n = 0; n < 2; ++n)
      TORCH_CHECK(w[n].scalar_type() == at::kFloat && w[n].is_contiguous() && w[n].numel() == hidden,
                  "quant_decoder_stack: norm weights float32 [hidden]");
    const int64_t i2 = s[5];
    TORCH_CHECK(s[1] == (H + 2 * KVH) * D && s[3] == hidden && i2 % 2 == 0 && s[7] == hidden &&
                    (inter == 0 || inter == i2 / 2),
                "quant_decoder_stack: projections of ", s[1], ", ", s[3], ", ", i2, " and ", s[7],
                " outputs do not match hidden ", hidden, " and the heads");
    inter = i2 / 2;
    const int64_t ins[4] = {hidden, HD, hidden, inter};
    for (int64_t p = 0; p < 4; ++p) {
      const at::Tensor &qp = w[2 + 3 * p], &dp = w[3 + 3 * p], &mp = w[4 + 3 * p];
      check_packed_weight("quant_decoder_stack", ins[p], qp, dp, mp, s[2 * p], s[2 * p + 1]);
      if (!packed_vector_path(B, s[2 * p], s[2 * p + 1]) || !qp.is_contiguous() || !dp.is_contiguous() ||
          !mp.is_contiguous())
        return {};
      const int64_t G = qp.size(0), grain = std::max<int64_t>(1, (32 << 10) / (qp.size(1) * qp.size(2) * B));
      projs.push_back({qp.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dp.data_ptr<at::Half>()),
                       reinterpret_cast<const uint16_t*>(mp.data_ptr<at::Half>()), s[2 * p], s[2 * p + 1], ins[p], G,
                       std::min(T, (G + grain - 1) / grain)});
    }
    kmax = std::max(kmax, inter);
  }
  at::Tensor out = x.clone();
  float* h = out.data_ptr<float>();
  // Shared: each written in disjoint parts, or by one thread, between barriers.
  std::vector<float> qkv(B * projs[0].N), q(B * HD), attn(B * HD), tmp(B * hidden), gu(B * 2 * inter);
  // Each share's own: the row-wise steps every thread runs.
  struct Own {
    std::vector<float> norm, act, dx, sx;
    std::vector<int8_t> qx;
  };
  std::vector<Own> own(T);
  for (Own& o : own)
    o.norm.resize(B * hidden), o.act.resize(B * inter), o.qx.resize(B * kmax), o.dx.resize(B * kmax / 32),
        o.sx.resize(B * kmax / 32);
  TeamBarrier barrier(T);
  team_calls.fetch_add(1);
  auto body = [&](int64_t s0, int64_t s1) {
    Own& me = own[s0];
    const int64_t n = s1 - s0;
    // Projection j over `in` ([B, K]) into dst ([B, N]): this thread's shares of its output
    // groups (the op's parallel_for split; taking runs of groups as the threads came free was
    // 1.1-1.3x slower: the streams broke up); `residual`: those columns of dst are then added
    // into h by the thread that computed them.
    auto project = [&](int64_t j, const float* in, float* dst, bool residual) {
      const TeamProj& p = projs[j];
      quantize_rows(in, B, p.K, me.qx.data(), me.dx.data(), me.sx.data());
      const int64_t chunk = (p.G + p.threads - 1) / p.threads;
      const int64_t g0 = std::min(p.G, s0 * chunk), g1 = std::min(p.G, s1 * chunk);
      if (g0 >= g1) return;
      packed_groups_auto(p.q, p.d, p.m, p.bits, p.N, p.K, B, me.qx.data(), me.dx.data(), me.sx.data(), g0, g1, dst);
      if (!residual) return;
      const int64_t c1 = std::min(p.N, g1 * 16);
      for (int64_t r = 0; r < B; ++r)
        for (int64_t c = g0 * 16; c < c1; ++c) h[r * hidden + c] += dst[r * p.N + c];
    };
    for (int64_t i = 0; i < L; ++i) {
      const float* w0 = weights[14 * i].data_ptr<float>();
      const float* w1 = weights[14 * i + 1].data_ptr<float>();
      rms_norm_rows(h, w0, me.norm.data(), B, hidden, static_cast<float>(eps));
      project(4 * i, me.norm.data(), qkv.data(), false);
      barrier.wait(n);
      if (s0 == 0) attention->write(i, qkv.data(), q.data());
      barrier.wait(n);
      attention->attend(i, q.data(), attn.data());
      barrier.wait(n);
      if (attention->split()) {
        for (int64_t s = s0; s < s1; ++s) attention->merge(i, attn.data(), s, T);
        barrier.wait(n);
      }
      project(4 * i + 1, attn.data(), tmp.data(), true);
      barrier.wait(n);
      rms_norm_rows(h, w1, me.norm.data(), B, hidden, static_cast<float>(eps));
      project(4 * i + 2, me.norm.data(), gu.data(), false);
      barrier.wait(n);
      silu_and_mul_rows(gu.data(), me.act.data(), B, inter);
      project(4 * i + 3, me.act.data(), tmp.data(), true);
      barrier.wait(n);
    }
  };
  if (T == 1) {
    body(0, 1);
  } else {
    at::parallel_for(0, T, 1, body);
  }
  return out;
}

// x [B, hidden] fp32, the B decode tokens' embeddings; per layer, `weights` holds 14 tensors:
// the input and post-attention norm weights, then (qp, dp, mp) of qkv_proj, o_proj,
// gate_up_proj and down_proj; `shapes` holds 8 ints: (bits, out_features) of the same four.
// k_caches/v_caches: each layer's cache; cos/sin [B, head_dim] (sin signed, as rotary_write_kv
// takes it); slots [B]; block_tables [B, max_blocks] and context_lens [B] as the paged decode
// attention takes them. LoRA, for G groups of rows (G = lora_rows.size(), 0: none): per group,
// layer and projection, lora_weights holds the slot's (A, B^T) (an empty pair where the group's
// adapter does not target the projection) and lora_ints (rank, mask); lora_bounds holds, per
// layer and projection, 5 ints: its pieces P, then their P + 1 output row boundaries, padded;
// group g's rows are lora_rows[g] (a long index) or, where that is empty,
// [lora_ranges[2g], + lora_ranges[2g+1]). Returns the residual stream after the last layer
// (before the final norm). k_scales/v_scales: each layer's cache scales where the cache is
// quantized (kernels/kv_quant.py), else empty. `tiles`: the projections take the AMX bf16 tile
// kernel (quant_linear_bf16) instead of the int8 one, as the layers' do for as many rows
// (kernels/quant.py `TILE_MIN_ROWS`: the caller decides).
at::Tensor quant_decoder_stack(const at::Tensor& x, at::TensorList weights, at::IntArrayRef shapes,
                               at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                               double eps, double scale, at::TensorList lora_weights, at::IntArrayRef lora_ints,
                               at::IntArrayRef lora_bounds, at::IntArrayRef lora_ranges, at::TensorList lora_rows,
                               at::TensorList k_scales, at::TensorList v_scales, bool tiles) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const int64_t G = static_cast<int64_t>(lora_rows.size());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_decoder_stack: x must be [B, hidden] float32");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 14 * L && static_cast<int64_t>(shapes.size()) == 8 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "quant_decoder_stack: per layer 14 weights, 8 shape ints and one K and V cache");
  TORCH_CHECK(static_cast<int64_t>(lora_weights.size()) == G * L * 8 && static_cast<int64_t>(lora_ints.size()) == G * L * 8 &&
                  static_cast<int64_t>(lora_ranges.size()) == 2 * G &&
                  (G == 0 || static_cast<int64_t>(lora_bounds.size()) == L * 20),
              "quant_decoder_stack: per LoRA group 8 tensors and 8 ints per layer, and 2 range ints; 20 bound ints per layer");
  const bool scaled = !k_scales.empty();
  TORCH_CHECK(static_cast<int64_t>(k_scales.size()) == (scaled ? L : 0) && v_scales.size() == k_scales.size(),
              "quant_decoder_stack: one K and one V scale per layer for a quantized cache, none otherwise");
  if (G == 0 && !tiles) {
    at::Tensor out = team_stack(x, weights, shapes, k_caches, v_caches, cos, sin, slots, block_tables, context_lens,
                                num_heads, num_kv_heads, eps, scale, k_scales, v_scales);
    if (out.defined()) return out;
  }
  const int64_t B = x.size(0), D = v_caches.empty() ? 0 : v_caches[0].size(3);
  at::Tensor h = x;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + 14 * i;
    const int64_t* s = shapes.data() + 8 * i;
    auto linear = [&](const at::Tensor& in, int64_t p) {  // projection p: 0 qkv, 1 o, 2 gate_up, 3 down
      at::Tensor out = tiles ? quant_linear_bf16(in, w[2 + 3 * p], w[3 + 3 * p], w[4 + 3 * p], s[2 * p], s[2 * p + 1])
                             : quant_linear_packed(in, w[2 + 3 * p], w[3 + 3 * p], w[4 + 3 * p], s[2 * p], s[2 * p + 1], "auto");
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at_ = ((g * L + i) * 4 + p) * 2;
        if (lora_weights[at_].numel() == 0) continue;
        const int64_t* e = lora_bounds.data() + (i * 4 + p) * 5;  // P, then P + 1 bounds (padded to 4)
        const at::Tensor& rows = lora_rows[g];
        const int64_t n = rows.numel() > 0 ? rows.numel() : lora_ranges[2 * g + 1];
        lora_update(out, in, lora_weights[at_], lora_weights[at_ + 1], e + 1, e[0], lora_ints[at_], lora_ints[at_ + 1], rows,
                    lora_ranges[2 * g], n);
      }
      return out;
    };
    const at::Tensor qkv = linear(rms_norm(h, w[0], eps), 0);
    std::optional<at::Tensor> ks, vs;
    if (scaled) ks = k_scales[i], vs = v_scales[i];
    const at::Tensor q = rotary_write_kv(qkv, cos, sin, k_caches[i], v_caches[i], slots, num_heads, num_kv_heads, ks, vs);
    const at::Tensor attn = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, context_lens, scale, 0, 0.0,
                                                   ks, vs);
    h = h + linear(attn.view({B, num_heads * D}), 1);
    const at::Tensor normed = rms_norm(h, w[1], eps);
    bool gate_up_lora = false;
    for (int64_t g = 0; g < G; ++g) gate_up_lora = gate_up_lora || lora_weights[((g * L + i) * 4 + 2) * 2].numel() > 0;
    // On the tiles a fused gate/up projection leaves as silu(gate) * up (quant_swiglu_bf16), as
    // the layers' does (kernels/quant.py `packed_swiglu`), unless an adapter reads its output.
    const at::Tensor act = tiles && !gate_up_lora && s[5] % 32 == 0
                               ? quant_swiglu_bf16(normed, w[8], w[9], w[10], s[4], s[5])
                               : silu_and_mul(linear(normed, 2));
    h = h + linear(act, 3);
  }
  return h;
}

// The same stack for a dense fp32 or bf16 model's all-decode step of 1-4 rows, as
// LlamaDecoderLayer.forward runs it then: each projection by blocked_matvec over oneDNN's packed
// weight (engine/execution/layers/linear.py `BlockedWeight`), RMSNorm by torch's op in fp32 (the
// reference's bits, F.rms_norm) and by the native one in bf16 (kernels/norm.py's choice), so its
// results are the layers' bits. Per layer `weights` holds 10 tensors: the two norm weights (in
// x's dtype), then (packed buffer, bias or an empty tensor) of qkv_proj, o_proj, gate_up_proj and
// down_proj; `shapes` 8 ints: (n, kp) of the same four. The rest as quant_decoder_stack's.
at::Tensor dense_decoder_stack(const at::Tensor& x, at::TensorList weights, at::IntArrayRef shapes,
                               at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                               const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                               double eps, double scale, at::TensorList k_scales, at::TensorList v_scales) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.size(0) <= 4,
              "dense_decoder_stack: x must be [B <= 4, hidden], float32 or bfloat16");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 10 * L && static_cast<int64_t>(shapes.size()) == 8 * L &&
                  static_cast<int64_t>(v_caches.size()) == L,
              "dense_decoder_stack: per layer 10 weights, 8 shape ints and one K and V cache");
  const bool scaled = !k_scales.empty();
  TORCH_CHECK(static_cast<int64_t>(k_scales.size()) == (scaled ? L : 0) && v_scales.size() == k_scales.size(),
              "dense_decoder_stack: one K and one V scale per layer for a quantized cache, none otherwise");
  const bool fp32 = x.scalar_type() == at::kFloat;
  const int64_t B = x.size(0), H = x.size(1), D = v_caches.empty() ? 0 : v_caches[0].size(3);
  auto norm = [&](const at::Tensor& in, const at::Tensor& w) {
    return fp32 ? at::rms_norm(in, {H}, w, eps) : rms_norm(in, w, eps);
  };
  at::Tensor h = x;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor* w = weights.data() + 10 * i;
    const int64_t* s = shapes.data() + 8 * i;
    auto linear = [&](const at::Tensor& in, int64_t p) {  // projection p: 0 qkv, 1 o, 2 gate_up, 3 down
      const at::Tensor& bias = w[3 + 2 * p];
      return blocked_matvec(in, w[2 + 2 * p], s[2 * p], s[2 * p + 1],
                            bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt, false);
    };
    std::optional<at::Tensor> ks, vs;
    if (scaled) ks = k_scales[i], vs = v_scales[i];
    const at::Tensor q =
        rotary_write_kv(linear(norm(h, w[0]), 0), cos, sin, k_caches[i], v_caches[i], slots, num_heads, num_kv_heads, ks, vs);
    const at::Tensor attn = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables, context_lens, scale, 0, 0.0,
                                                   ks, vs);
    h = h + linear(attn.view({B, num_heads * D}), 1);
    h = h + linear(silu_and_mul(linear(norm(h, w[1]), 2)), 3);
  }
  return h;
}

}  // namespace triollm_cpu

TORCH_LIBRARY_FRAGMENT(triollm_cpu, m) {
  m.def("quant_decoder_stack(Tensor x, Tensor[] weights, int[] shapes, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, int num_heads, int num_kv_heads, float eps, float scale, "
        "Tensor[] lora_weights, int[] lora_ints, int[] lora_bounds, int[] lora_ranges, Tensor[] lora_rows, "
        "Tensor(c!)[] k_scales, Tensor(d!)[] v_scales, bool tiles=False) -> Tensor");
  m.def("dense_decoder_stack(Tensor x, Tensor[] weights, int[] shapes, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, int num_heads, int num_kv_heads, float eps, float scale, "
        "Tensor(c!)[] k_scales, Tensor(d!)[] v_scales) -> Tensor");
  m.def("team_stack_calls() -> int", &triollm_cpu::team_stack_calls);
  m.def("lora_apply(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, int[] bounds, int rank, int mask, Tensor rows, "
        "int start, int n) -> ()");
}

TORCH_LIBRARY_IMPL(triollm_cpu, CPU, m) {
  m.impl("quant_decoder_stack", &triollm_cpu::quant_decoder_stack);
  m.impl("dense_decoder_stack", &triollm_cpu::dense_decoder_stack);
  m.impl("lora_apply", &triollm_cpu::lora_apply);
}
