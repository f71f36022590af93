// Paged decode attention on CPU: one query token per sequence, reading K/V in place from the
// paged cache (no gather), with an online softmax over the sequence's blocks.
//
// Layout (kernels/attention.py): per layer V is [kv_heads, num_blocks, block_size, hd] and K is
// [kv_heads, num_blocks, hd, block_size] (each block transposed); q and out are [B, H, hd]; block_tables [B, M] int32 (row b's first ceil(len/bs) entries are
// used); context_lens [B] int32 (the query's own token included, its K/V already written).
//
// Work is split over (sequence, kv head) pairs with ATen's thread pool: each pair reads its K/V
// blocks once for the whole GQA group of query heads. Scores and the running sum are fp32
// whatever the cache dtype (bf16/fp16 are widened block by block into a small fp32 buffer).
// The cache may be bf16 under fp32 queries (kv_cache_dtype): half the bytes to read, which at
// large batches is most of a decode step's memory traffic; or quantized (kernels/kv_quant.py),
// a quarter: fp8 (e4m3fn, e5m2) with one scale per layer for K and one for V, folded out of
// the loops (K's into the query's scale, V's into the final normalisation), or int8 with an
// fp16 scale per (token, kv head), applied once per token: to its score after the dot product
// and to its probability before P.V. fp8 codes widen to fp32 by integer shifts (a normal code's
// exponent and mantissa bits placed in a float, times the bias difference; a subnormal one from
// its mantissa as an integer), which vectorises like the bf16 shift.
// With K transposed, a block's scores are block_size-wide vertical FMAs over head_dim (no
// horizontal sums), and P.V adds each V row, scaled, to the group's accumulators.
//
// Sliding window (Mistral, Qwen2, Gemma 2/3; `window` > 0): a row of length n attends positions
// [max(0, n - window), n). The start is computed once per pair; the loop begins at the block
// holding it (blocks wholly before it are never read) and masks that block's positions before
// it, like the tail past n. window 0 starts at block 0 with nothing masked: the code that ran
// before windows existed. Soft-capping (Gemma 2; `softcap` > 0): each fp32 score becomes
// softcap * tanh(score / softcap) before the softmax. It is a template flag (kCap) of the
// generic and block-16 instances only: the GQA-group instances are never built with it (a
// soft-capped call takes decode_pair), so the uncapped instances are the same code as before
// and the build grows by three functions per dtype pair, not seventeen.
//
// Attention sinks (gpt-oss; `sinks` [H] fp32): a logit per query head that joins the softmax's
// denominator and carries no value. It enters once per pair, after the blocks: the running max
// and sum are moved to max(m, sink) and the sink's exp added to the sum, so the loops are the
// ones above. Chunked local attention (Llama 4; `chunk` > 0): the query at position n - 1 sees
// positions [(n - 1) / chunk * chunk, n), which is one more lower bound on `start` (the later of
// the window's and the chunk's), computed once per pair like the window's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <immintrin.h>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace triollm_cpu {

// A row's context is attended in parts of this many blocks, merged after (decode, below). A part
// costs more than its blocks (its task claimed, its stream of blocks started cold, its output
// written and merged): 64 took 0.85-0.91x the time of 32 at 8k tokens and 128 0.80-0.87x
// (docs/architecture.md, "Long rows in parts"); 64 leaves a many-core server eight parts a kv head
// to spread at 8k tokens.
constexpr int64_t kPartBlocks = 64;
constexpr int64_t kMaxParts = 64;  // the merge's weights' initial room (more grows it)

// The running max starts here rather than at -inf: the kernel is built with -ffast-math (for
// vectorised exp), which assumes finite values. exp(kNegBig - m) underflows to 0 as exp(-inf).
constexpr float kNegBig = -1e30f;

// Conversions that vectorise: c10's bf16 constructor checks for NaN with a branch, so a loop
// that narrows through it stays scalar; here bf16 is widened by a shift and narrowed with
// round-to-nearest-even on the bits (-ffast-math assumes no NaN anyway).
template <typename T>
inline float load_f(T v) {
  return static_cast<float>(v);
}
template <>
inline float load_f<c10::BFloat16>(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// fp8 codes to fp32. e4m3fn: s eeee mmm, bias 7; e5m2: s eeeee mm, bias 15 (the high byte of an
// fp16). A normal code's bits shifted into a float's exponent and mantissa fields give a normal
// float 2^(e - 127) * 1.m, times 2^(127 - bias); a subnormal code (e = 0) is m * 2^(1 - bias -
// mantissa bits). No float here is subnormal, so flush-to-zero modes change nothing. The codes
// the writers store are finite (saturated), so the NaN code is never read.
// e4m3fn is read as its value times 2^-8 (kRaw), what the vector path gets for free by taking
// its bits as an fp16's (bias 15, not 7); `decode` folds the 2^8 back into its scales.
template <typename K>
constexpr float kRaw = std::is_same_v<K, c10::Float8_e4m3fn> ? 0x1p-8f : 1.f;
template <>
inline float load_f<c10::Float8_e4m3fn>(c10::Float8_e4m3fn v) {
  const uint32_t x = v.x, mag = x & 0x7Fu;
  float normal, sub = static_cast<float>(mag & 0x7u) * 0x1p-17f;
  const uint32_t nbits = mag << 20;
  std::memcpy(&normal, &nbits, sizeof normal);
  normal *= 0x1p112f;
  const float f = (mag >> 3) ? normal : sub;
  return (x & 0x80u) ? -f : f;
}
template <>
inline float load_f<c10::Float8_e5m2>(c10::Float8_e5m2 v) {
  const uint32_t x = v.x, mag = x & 0x7Fu;
  float normal, sub = static_cast<float>(mag & 0x3u) * 0x1p-16f;
  const uint32_t nbits = mag << 21;
  std::memcpy(&normal, &nbits, sizeof normal);
  normal *= 0x1p112f;
  const float f = (mag >> 2) ? normal : sub;
  return (x & 0x80u) ? -f : f;
}
template <>
inline float load_f<int8_t>(int8_t v) {
  return static_cast<float>(v);
}

template <typename K>
constexpr bool kPerToken = std::is_same_v<K, int8_t>;  // int8: a scale per (token, kv head)
template <typename K>
constexpr bool kQuantized = kPerToken<K> || std::is_same_v<K, c10::Float8_e4m3fn> ||
                            std::is_same_v<K, c10::Float8_e5m2>;

// 16 cached values (or fp16 scales) as fp32, the inner step of the block-16 kernels. With
// AVX-512 the quantized types take a few instructions per 16 values: fp8 becomes the bits of an
// fp16 (e5m2 is an fp16's high byte; e4m3fn's exponent and mantissa shifted into an fp16's,
// exact for subnormals too: the value times 2^-8, kRaw), converted by vcvtph2ps;
// int8 is sign-extended and converted. Elsewhere (and for the plain types, which the compiler
// vectorises by itself) it is `load_f` per value.
template <typename K>
inline void widen16(const K* src, float* dst) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<K, c10::Float8_e4m3fn> || std::is_same_v<K, c10::Float8_e5m2>) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    if constexpr (std::is_same_v<K, c10::Float8_e5m2>) {
      _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_slli_epi16(w, 8)));
    } else {  // sign to bit 15, then an arithmetic shift puts the rest at bits 7..13
      const __m256i bits = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 1);
      _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_and_si256(bits, _mm256_set1_epi16(static_cast<short>(0xBFFF)))));
    }
    return;
  } else if constexpr (std::is_same_v<K, int8_t>) {
    const __m512i i = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(i));
    return;
  } else if constexpr (std::is_same_v<K, c10::Half>) {
    _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
    return;
  }
#endif
#pragma omp simd
  for (int t = 0; t < 16; ++t) dst[t] = load_f(src[t]);
}

// A layer's quantization scales as the decode kernels take them: int8's per-token fp16 scales
// ([kv_heads, num_blocks, block_size], null otherwise) and fp8's V scale (1 otherwise; K's is
// folded into the query's scale by the caller).
struct Scales {
  const c10::Half* k = nullptr;
  const c10::Half* v = nullptr;
  float v_layer = 1.f;
};

template <typename T>
inline T store_f(float f) {
  return static_cast<T>(f);
}
template <>
inline c10::BFloat16 store_f<c10::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// K/V rows of one block as fp32: a pointer into the cache itself for fp32, else a widened copy.
// n fp8 codes (a multiple of 32) as fp32 (times kRaw), 32 at a time: the shifts run on 32
// 16-bit lanes at once, so a value costs little more than its vcvtph2ps.
template <typename K>
inline void widen_fp8(const K* src, float* dst, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t i = 0; i < n; i += 32) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    w = _mm512_slli_epi16(w, 8);
    if constexpr (std::is_same_v<K, c10::Float8_e4m3fn>)
      w = _mm512_and_si512(_mm512_srai_epi16(w, 1), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm512_castsi512_si256(w)));
    _mm512_storeu_ps(dst + i + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1)));
  }
#else
  for (int64_t i = 0; i < n; i += 16) widen16(src + i, dst + i);
#endif
}

template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (kQuantized<T>) {
    if constexpr (!kPerToken<T>) {
      if (n % 32 == 0) {
        widen_fp8(src, buf, n);
        return buf;
      }
    }
    if (n % 16 == 0) {
      for (int64_t i = 0; i < n; i += 16) widen16(src + i, buf + i);
      return buf;
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = load_f(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

// Gemma 2's attention-logit soft-capping of n fp32 scores: cap * tanh(score / cap).
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

// 1 / the softmax's denominator for a head whose blocks left running max m and sum l (the
// accumulated P.V is relative to exp(m)); with a sink, the sum gains exp(sink), both taken
// relative to max(m, sink) so that neither overflows.
inline float normaliser(float m, float l, const float* sink) {
  if (sink == nullptr) return 1.f / l;
  const float mx = std::max(m, *sink);
  const float rel = std::exp(m - mx);
  return rel / (l * rel + std::exp(*sink - mx));
}

// One block's `bs` scores of one query head, in place: positions past `cnt` and before `skip`
// masked, then exponentiated relative to the new running max (m, l updated); returns the factor
// the head's accumulated P.V takes for the new max.
inline float softmax_block(float* s, int64_t bs, int64_t cnt, int64_t skip, float& m, float& l) {
  for (int64_t t = cnt; t < bs; ++t) s[t] = kNegBig;  // past the sequence's end
  for (int64_t t = 0; t < skip; ++t) s[t] = kNegBig;  // before the window
  float mx = m;
  for (int64_t t = 0; t < bs; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < bs; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float corr = std::exp(m - mx);
  l = l * corr + sum;
  m = mx;
  return corr;
}

// A pair's output value i: into the output row (rounded to T), or, for one part of a split row
// (`part`, see decode), into that part's fp32 buffer.
template <typename T>
inline void emit(T* orow, float* part, int64_t i, float v) {
  if (part != nullptr) {
    part[i] = v;
  } else {
    orow[i] = store_f<T>(v);
  }
}

// The merge of a split row's parts (flash decoding's split, see decode) for one kv head's G query
// heads, parts in order: out = sum_p w_p part_p, w_p = exp(lse_p - mx) / (sum_p exp(lse_p - mx)
// [+ exp(sink - mx)]), mx the largest of them (a sink joins the denominator once, here).
// part [parts][G][D], lse [parts][G]; sinks and orow: the first query head's. Not inlined and not
// vectorised: the decode and prefill kernels run the same machine code, and no loop is peeled by
// its buffers' alignment (a vector expf and the scalar one differ in the last bit).
template <typename T>
__attribute__((noinline, optimize("no-tree-vectorize"))) void merge_parts(
    const float* part, const float* lse, int64_t parts, int64_t G, int64_t D, const float* sinks, T* orow,
    std::vector<float>& w) {
  w.resize(parts);
  for (int64_t g = 0; g < G; ++g) {
    const float* sink = sinks ? sinks + g : nullptr;
    float mx = sink ? *sink : kNegBig;
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, lse[p * G + g]);
    float den = sink ? std::exp(*sink - mx) : 0.f;
    for (int64_t p = 0; p < parts; ++p) den += w[p] = std::exp(lse[p * G + g] - mx);
    for (int64_t p = 0; p < parts; ++p) w[p] /= den;
    T* o = orow + g * D;
    for (int64_t d = 0; d < D; ++d) {
      float v = 0.f;
      for (int64_t p = 0; p < parts; ++p) v += w[p] * part[(p * G + g) * D + d];
      o[d] = store_f<T>(v);
    }
  }
}

// One (sequence, kv head) pair: its GQA group of G query heads over the sequence's blocks.
// BS (block size) and D (head dim) are template parameters where they are common (16 x 64,
// 16 x 128): the block's scores and the group's partial P.V then live in registers (fixed-size
// local arrays, fully unrolled); 0 means "the runtime value" (the generic instance, slower).
// `start` is the first position attended (0 without a window); `cap` the soft-cap (read only
// when kCap).
template <typename T, typename K, int kBS, int kD, bool kCap = false>
void decode_pair(const T* qrow, const K* kp, const K* vp, const int32_t* table, int64_t n,
                 int64_t start, int64_t G, int64_t NB, int64_t h, int64_t rt_bs, int64_t rt_d,
                 float fscale, float cap, const float* sink, const Scales& sc, float* qf,
                 float* acc, float* kbuf,
                 float* vbuf, float* s, float* m, float* l, T* orow, float* part, float* lse) {
  const int64_t BS = kBS ? kBS : rt_bs;
  const int64_t D = kD ? kD : rt_d;
  for (int64_t j = 0; j < G * D; ++j) qf[j] = load_f(qrow[j]) * fscale;
  for (int64_t j = 0; j < G * D; ++j) acc[j] = 0.f;
  for (int64_t g = 0; g < G; ++g) m[g] = kNegBig, l[g] = 0.f;
  for (int64_t blk = start / BS; blk * BS < n; ++blk) {
    const int64_t id = table[blk];
    const int64_t cnt = std::min(BS, n - blk * BS);
    const int64_t base = ((h * NB + id) * BS) * D;
    const float* kt = as_float(kp + base, kbuf, D * BS);  // [D][BS]
    const float* vf = as_float(vp + base, vbuf, cnt * D);  // [cnt][D]
    float ks[kPerToken<K> ? (kBS ? kBS : 64) : 1], vs[kPerToken<K> ? (kBS ? kBS : 64) : 1];
    if constexpr (kPerToken<K>) {
      if constexpr (kBS == 16) {
        widen16(sc.k + (h * NB + id) * BS, ks);
        widen16(sc.v + (h * NB + id) * BS, vs);
      } else {
        for (int64_t t = 0; t < BS; ++t) {
          ks[t] = static_cast<float>(sc.k[(h * NB + id) * BS + t]);
          vs[t] = static_cast<float>(sc.v[(h * NB + id) * BS + t]);
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float* sg = s + g * BS;
      if constexpr (kBS != 0) {
        // Two independent accumulator chains over head_dim hide the FMA latency.
        float s0[kBS] = {}, s1[kBS] = {};
        for (int64_t d = 0; d < D; d += 2) {
          const float q0 = qg[d], q1 = qg[d + 1];
          const float* k0 = kt + d * kBS;
          const float* k1 = k0 + kBS;
#pragma omp simd
          for (int t = 0; t < kBS; ++t) {
            s0[t] += q0 * k0[t];
            s1[t] += q1 * k1[t];
          }
        }
#pragma omp simd
        for (int t = 0; t < kBS; ++t) sg[t] = s0[t] + s1[t];
      } else {
        for (int64_t t = 0; t < BS; ++t) sg[t] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qg[d];
          const float* kd = kt + d * BS;
#pragma omp simd
          for (int64_t t = 0; t < BS; ++t) sg[t] += qd * kd[t];
        }
      }
      if constexpr (kPerToken<K>) {
        for (int64_t t = 0; t < BS; ++t) sg[t] *= ks[t];
      }
      if constexpr (kCap) soft_cap(sg, BS, cap);
      const float corr = softmax_block(sg, BS, cnt, start - blk * BS, m[g], l[g]);
      float* ag = acc + g * D;
      if constexpr (kD != 0) {
        float a[kD];  // this block's P.V for head g, in registers
#pragma omp simd
        for (int d = 0; d < kD; ++d) a[d] = ag[d] * corr;
        for (int64_t t = 0; t < cnt; ++t) {
          const float p = kPerToken<K> ? sg[t] * vs[t] : sg[t];
          const float* vt = vf + t * kD;
#pragma omp simd
          for (int d = 0; d < kD; ++d) a[d] += p * vt[d];
        }
#pragma omp simd
        for (int d = 0; d < kD; ++d) ag[d] = a[d];
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
        for (int64_t t = 0; t < cnt; ++t) {
          const float p = kPerToken<K> ? sg[t] * vs[t] : sg[t];
          const float* vt = vf + t * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = sc.v_layer * normaliser(m[g], l[g], sink ? sink + g : nullptr);
    if (part != nullptr) lse[g] = m[g] + std::log(l[g]);
    for (int64_t d = 0; d < D; ++d) emit(orow, part, g * D + d, acc[g * D + d] * inv);
  }
}

// Many query heads, or a head_dim without an instance of its own (16 x D, D a multiple of 16:
// DeepSeek's latent attention, 16-128 heads over one 576-wide KV head; Gemma's 256; Phi's 80 and
// 96): `decode_pair`'s arithmetic, in fp32, blocked for registers. A block's scores are kGC heads
// at a time, each over kS interleaved chains of head_dim (so that the FMAs of one head do not
// wait on each other where few heads share the block); P.V is kGC heads x kDC 16-wide chunks of
// head_dim at a time, the accumulators read from and written back to `acc` once a block.
template <int kGC, int kS>
inline void wide_scores(const float* qf, int64_t D, const float* kt, float* s) {
  float a[kGC][kS][16] = {};
  for (int64_t d = 0; d < D; d += kS)
    for (int j = 0; j < kS; ++j) {
      const float* kr = kt + (d + j) * 16;
      for (int g = 0; g < kGC; ++g) {
        const float qv = qf[g * D + d + j];
#pragma omp simd
        for (int t = 0; t < 16; ++t) a[g][j][t] += qv * kr[t];
      }
    }
  for (int g = 0; g < kGC; ++g)
#pragma omp simd
    for (int t = 0; t < 16; ++t) {
      float v = a[g][0][t];
      for (int j = 1; j < kS; ++j) v += a[g][j][t];
      s[g * 16 + t] = v;
    }
}

template <int kGC, int kDC>
inline void wide_pv(float* acc, int64_t D, int64_t c0, const float* p, const float* corr, const float* vf,
                    int64_t cnt) {
  float a[kGC][kDC][16];
  for (int g = 0; g < kGC; ++g)
    for (int c = 0; c < kDC; ++c)
#pragma omp simd
      for (int t = 0; t < 16; ++t) a[g][c][t] = acc[g * D + (c0 + c) * 16 + t] * corr[g];
  for (int64_t t = 0; t < cnt; ++t) {
    const float* vt = vf + t * D + c0 * 16;
    for (int g = 0; g < kGC; ++g) {
      const float pv = p[g * 16 + t];
      for (int c = 0; c < kDC; ++c)
#pragma omp simd
        for (int i = 0; i < 16; ++i) a[g][c][i] += pv * vt[c * 16 + i];
    }
  }
  for (int g = 0; g < kGC; ++g)
    for (int c = 0; c < kDC; ++c)
#pragma omp simd
      for (int t = 0; t < 16; ++t) acc[g * D + (c0 + c) * 16 + t] = a[g][c][t];
}

template <int kGC, int kDC>
inline void wide_pv_all(float* acc, int64_t D, const float* p, const float* corr, const float* vf, int64_t cnt) {
  const int64_t chunks = D / 16;
  int64_t c = 0;
  for (; c + kDC <= chunks; c += kDC) wide_pv<kGC, kDC>(acc, D, c, p, corr, vf, cnt);
  for (; c < chunks; ++c) wide_pv<kGC, 1>(acc, D, c, p, corr, vf, cnt);
}

// The K and V lines of the block two ahead (and an int8 cache's scales for it), requested into
// L2 while this one computes. A sequence's blocks lie wherever the cache had room when it grew
// (interleaved with other sequences' blocks, or in falling order after frees), and there the
// hardware prefetcher, which follows addresses, stops at each block's end. A bf16 or fp32 block
// that directly follows the one before it is left to the hardware, which is streaming it
// already: requesting it anyway made a long row 10-15% slower; a quantized block (half the
// bytes, read at twice the rate) is requested either way. Into L2, not L1: a block's 32-64
// lines requested into L1 at once held the misses the loads themselves wait on. Measured against
// that rule (the next block into L1; Zen 4, 8,192 tokens x 30 layers of the bundled model's
// shape, docs/benchmarks.md [prefetch]): blocks in random or falling order 0.76-0.83x the time,
// every other block 0.85-0.93x, blocks in order 0.83-0.94x.
template <typename K>
inline void prefetch_ahead(const K* kp, const K* vp, const int32_t* table, int64_t blk, int64_t n, int64_t h,
                           int64_t NB, int64_t D, const Scales& sc) {
  constexpr int64_t kAhead = 2;
  const int64_t bytes = D * 16 * static_cast<int64_t>(sizeof(K));
  if ((blk + kAhead) * 16 >= n) return;
  const int64_t id = table[blk + kAhead];
  if (!kQuantized<K> && id == table[blk + kAhead - 1] + 1) return;
  const char* kb = reinterpret_cast<const char*>(kp + (h * NB + id) * D * 16);
  const char* vb = reinterpret_cast<const char*>(vp + (h * NB + id) * D * 16);
  for (int64_t at = 0; at < bytes; at += 64) {
    __builtin_prefetch(kb + at, 0, 2);
    __builtin_prefetch(vb + at, 0, 2);
  }
  if constexpr (kPerToken<K>) {  // 16 fp16 scales each: half a line
    __builtin_prefetch(sc.k + (h * NB + id) * 16, 0, 2);
    __builtin_prefetch(sc.v + (h * NB + id) * 16, 0, 2);
  }
}

template <typename T, typename K, bool kCap>
void decode_pair_wide(const T* qrow, const K* kp, const K* vp, const int32_t* table, int64_t n, int64_t start,
                      int64_t G, int64_t NB, int64_t h, int64_t, int64_t D, float fscale, float cap,
                      const float* sink, const Scales& sc, float* qf, float* acc, float* kbuf, float* vbuf, float* s,
                      float* m, float* l, T* orow, float* part, float* lse) {
  constexpr int64_t kBS = 16;
  for (int64_t j = 0; j < G * D; ++j) qf[j] = load_f(qrow[j]) * fscale;
  for (int64_t j = 0; j < G * D; ++j) acc[j] = 0.f;
  for (int64_t g = 0; g < G; ++g) m[g] = kNegBig, l[g] = 0.f;
  float corr[8], p[8 * kBS];
  prefetch_ahead<K>(kp, vp, table, start / kBS - 1, n, h, NB, D, sc);  // the second block
  for (int64_t blk = start / kBS; blk * kBS < n; ++blk) {
    const int64_t id = table[blk];
    const int64_t cnt = std::min(kBS, n - blk * kBS);
    prefetch_ahead<K>(kp, vp, table, blk, n, h, NB, D, sc);
    const int64_t base = ((h * NB + id) * kBS) * D;
    const float* kt = as_float(kp + base, kbuf, D * kBS);  // [D][16]
    const float* vf = as_float(vp + base, vbuf, cnt * D);  // [cnt][D]
    float ks[kPerToken<K> ? kBS : 1], vs[kPerToken<K> ? kBS : 1];
    if constexpr (kPerToken<K>) {
      widen16(sc.k + (h * NB + id) * kBS, ks);
      widen16(sc.v + (h * NB + id) * kBS, vs);
    }
    for (int64_t g0 = 0; g0 < G;) {
      const int64_t rest = G - g0;
      const int gc = rest >= 8 ? 8 : rest >= 4 ? 4 : rest >= 2 ? 2 : 1;
      float* sg = s + g0 * kBS;
      switch (gc) {
        case 8: wide_scores<8, 1>(qf + g0 * D, D, kt, sg); break;
        case 4: wide_scores<4, 2>(qf + g0 * D, D, kt, sg); break;
        case 2: wide_scores<2, 4>(qf + g0 * D, D, kt, sg); break;
        default: wide_scores<1, 4>(qf + g0 * D, D, kt, sg); break;
      }
      for (int g = 0; g < gc; ++g) {
        float* sh = sg + g * kBS;
        if constexpr (kPerToken<K>) {
          for (int64_t t = 0; t < kBS; ++t) sh[t] *= ks[t];
        }
        if constexpr (kCap) soft_cap(sh, kBS, cap);
        corr[g] = softmax_block(sh, kBS, cnt, start - blk * kBS, m[g0 + g], l[g0 + g]);
        for (int64_t t = 0; t < kBS; ++t) p[g * kBS + t] = kPerToken<K> ? sh[t] * vs[t] : sh[t];
      }
      float* ag = acc + g0 * D;
      switch (gc) {
        case 8: wide_pv_all<8, 2>(ag, D, p, corr, vf, cnt); break;
        case 4: wide_pv_all<4, 4>(ag, D, p, corr, vf, cnt); break;
        case 2: wide_pv_all<2, 6>(ag, D, p, corr, vf, cnt); break;
        default: wide_pv_all<1, 8>(ag, D, p, corr, vf, cnt); break;
      }
      g0 += gc;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = sc.v_layer * normaliser(m[g], l[g], sink ? sink + g : nullptr);
    if (part != nullptr) lse[g] = m[g] + std::log(l[g]);
    for (int64_t d = 0; d < D; ++d) emit(orow, part, g * D + d, acc[g * D + d] * inv);
  }
}

// The common shapes with the GQA group size also fixed (kG query heads per kv head): the
// group's scores (kG x 16) and outputs (kG x kD) stay in registers, and each K and V row is
// widened once, in registers, for the whole group (no fp32 copy of the block; a quantized
// block is widened whole into one, see below).
template <typename T, typename K, int kD, int kG>
void decode_pair_group(const T* qrow, const K* kp, const K* vp, const int32_t* table, int64_t n,
                       int64_t start, int64_t, int64_t NB, int64_t h, int64_t, int64_t,
                       float fscale, float, const float* sink, const Scales& sc, float*, float*,
                       float*, float*,
                       float*, float*, float*, T* orow, float* part, float* lse) {
  constexpr int kBS = 16;
  float qf[kG][kD];
  for (int g = 0; g < kG; ++g)
    for (int d = 0; d < kD; ++d) qf[g][d] = load_f(qrow[g * kD + d]) * fscale;
  float acc[kG][kD] = {};
  float m[kG], l[kG] = {};
  for (int g = 0; g < kG; ++g) m[g] = kNegBig;
  prefetch_ahead<K>(kp, vp, table, start / kBS - 1, n, h, NB, kD, sc);  // the second block
  for (int64_t blk = start / kBS; blk * kBS < n; ++blk) {
    const int64_t id = table[blk];
    const int64_t cnt = std::min<int64_t>(kBS, n - blk * kBS);
    const K* kt = kp + (h * NB + id) * kD * kBS;  // [kD][kBS]
    const K* vb = vp + (h * NB + id) * kBS * kD;  // [kBS][kD]
    prefetch_ahead<K>(kp, vp, table, blk, n, h, NB, kD, sc);
    float s[kG][kBS] = {};
    // Quantized blocks are widened whole (fp8 32 values at a time) into fp32 copies in L1: the
    // conversions run back to back, apart from the FMAs that read them.
    constexpr bool kWholeBlock = kQuantized<K>;
    alignas(64) float kblk[kWholeBlock ? kD * kBS : 1];
    alignas(64) float vblk[kWholeBlock ? kBS * kD : 1];
    if constexpr (kWholeBlock) {
      as_float(kt, kblk, kD * kBS);
      as_float(vb, vblk, cnt * kD);
    }
    for (int d = 0; d < kD; ++d) {
      float kbuf[kBS];
      const float* kd = kbuf;
      if constexpr (kWholeBlock) {
        kd = kblk + d * kBS;
      } else {
#pragma omp simd
        for (int t = 0; t < kBS; ++t) kbuf[t] = load_f(kt[d * kBS + t]);
      }
      for (int g = 0; g < kG; ++g) {
        const float qd = qf[g][d];
#pragma omp simd
        for (int t = 0; t < kBS; ++t) s[g][t] += qd * kd[t];
      }
    }
    float vs[kBS];
    if constexpr (kPerToken<K>) {
      float ks[kBS];
      widen16(sc.k + (h * NB + id) * kBS, ks);
      widen16(sc.v + (h * NB + id) * kBS, vs);
      for (int g = 0; g < kG; ++g) {
#pragma omp simd
        for (int t = 0; t < kBS; ++t) s[g][t] *= ks[t];
      }
    }
    float corr[kG];
    for (int g = 0; g < kG; ++g) {
      corr[g] = softmax_block(s[g], kBS, cnt, start - blk * kBS, m[g], l[g]);
#pragma omp simd
      for (int d = 0; d < kD; ++d) acc[g][d] *= corr[g];
    }
    for (int64_t t = 0; t < cnt; ++t) {
      float vbuf[kD];
      const float* vt = vbuf;
      if constexpr (kWholeBlock) {
        vt = vblk + t * kD;
      } else {
#pragma omp simd
        for (int d = 0; d < kD; ++d) vbuf[d] = load_f(vb[t * kD + d]);
      }
      for (int g = 0; g < kG; ++g) {
        const float p = kPerToken<K> ? s[g][t] * vs[t] : s[g][t];
#pragma omp simd
        for (int d = 0; d < kD; ++d) acc[g][d] += p * vt[d];
      }
    }
  }
  for (int g = 0; g < kG; ++g) {
    const float inv = sc.v_layer * normaliser(m[g], l[g], sink ? sink + g : nullptr);
    if (part != nullptr) lse[g] = m[g] + std::log(l[g]);
    for (int d = 0; d < kD; ++d) emit(orow, part, g * kD + d, acc[g][d] * inv);
  }
}

// ------------------------------------------------------------------------------------------
// A bf16 cache on a CPU with AVX-512 BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids and later):
// the dot products run on `vdpbf16ps`, which multiplies pairs of bf16 values and adds both
// products to an fp32 lane, so a block's K and V are never widened to fp32 and each instruction
// does twice the FMA's work. Q meets K in the cache's precision: the query is rounded to bf16
// once per pair (exact for a bf16 model; for fp32 activations the same rounding the cache
// applied to K, as llama.cpp rounds Q to its f16 cache), the scale applied to the fp32 scores.
// The probabilities are rounded to bf16 before P.V (as flash attention rounds P to the value
// dtype); scores, the running max and sum, and the accumulators stay fp32.
//   Scores: K's block [kD][16] holds rows d and d + 1 as 64 contiguous bytes; `vpermw`
//   interleaves them into 16 lanes of (k[d][t], k[d+1][t]), and `vdpbf16ps` against the
//   broadcast pair (q[d], q[d+1]) adds both products to token t's lane.
//   P.V: rows t and t + 1 of V's block [16][kD], interleaved by `vpunpck{l,h}wd` (within
//   128-bit lanes, so the accumulators hold head_dim in a fixed permuted order, undone once at
//   the end), against the broadcast pair (p[t], p[t+1]); an odd last token pairs with zeros.
// The order of every sum is fixed by the block and the pair, so a row's result does not depend
// on its batch, as with the fp32 path (kernels/batch_invariant.py). Chosen at run time
// (`bf16_dot_enabled`): the CPU has AVX-512 BF16 and $TRIOLLM_CPU_ISA forces no other path.
//
// A quantized cache (fp8 e4m3fn / e5m2, int8) takes the same loops where the CPU also has
// AVX-512 VBMI (`quant_dot_enabled`: Zen 4/5, Ice Lake and later; not Cooper Lake): its codes
// become the bf16 pairs the dot products take, in registers (`bf16_words`). Every code of these formats is a
// bf16 value exactly (at most 4 significant bits, or an integer below 128), so this is a table
// lookup, not arithmetic: the code's magnitude (7 bits; int8's absolute value, the writers
// saturate to +-127) indexes two 128-entry byte tables, the bf16's high and low bytes
// (`vpermi2b`, 64 codes an instruction), the sign is or-ed into the high byte, and an unpack
// joins the bytes into words. Half the bytes of a bf16 cache are read and a value costs about
// what its bf16 load did, where the fp32 path above widened every value by arithmetic and
// spent an FMA on it. fp8 codes are looked up as their value times kRaw (the fp32 path's
// scaling, which `decode` folds back); int8's per-token scales multiply the scores after the
// dot product and the probabilities before they are rounded, as in the fp32 path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma,f16c")
inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// exp of 16 floats: 2^n * e^r, r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (ln 2 in two parts), e^r
// by a degree-6 polynomial (Cephes' expf, within 2 ulp), 2^n by `vscalefps`. The argument is
// clamped first: e^-88 is below every probability that survives bf16 rounding (masked positions
// are zeroed by the caller, not by underflow).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// n fp32 values (a multiple of 2) rounded to bf16, as n / 2 pairs (lower index in the low half).
inline void bf16_pairs(const float* src, int n, uint32_t* dst) {
  for (int i = 0; i < n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(src + i), hi = _mm512_loadu_ps(src + i + 16);
    // cvtne2ps: the second operand's 16 values land in the low half.
    _mm512_storeu_si512(reinterpret_cast<void*>(dst + i / 2), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// The bf16 bits of a quantized cache's codes, by magnitude (0..127): high bytes and low bytes,
// 64 entries a register (vpermi2b's two tables).
template <typename K>
struct Bf16Table {
  __m512i hi0, hi1, lo0, lo1;
  Bf16Table() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int c = 0; c < 128; ++c) {
      float f;
      if constexpr (std::is_same_v<K, int8_t>) {
        f = static_cast<float>(c);
      } else {
        f = load_f(K(static_cast<uint8_t>(c), K::from_bits()));  // times kRaw: exact in bf16
      }
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      hi[c] = static_cast<uint8_t>(bits >> 24), lo[c] = static_cast<uint8_t>(bits >> 16);
    }
    hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
  }
};

// 64 codes x (already in the order wanted) as 64 bf16 words: the first result's lane L holds
// the words of bytes 16L..16L+7, the second's of bytes 16L+8..16L+15 (the byte unpack joining
// low and high bytes works within 128-bit lanes).
template <typename K>
inline void bf16_words(__m512i x, const Bf16Table<K>& tab, __m512i& a, __m512i& b) {
  const __m512i mag = std::is_same_v<K, int8_t> ? _mm512_abs_epi8(x) : x;  // vpermi2b reads bits 0-6
  const __m512i lo = _mm512_permutex2var_epi8(tab.lo0, mag, tab.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(tab.hi0, mag, tab.hi1), x,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
  a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
}

// Byte orders (`vpermb` / `vpermt2b` indices) that make bf16_words give the dot products' pairs
// directly. K: 64 codes are rows d..d+3 of a transposed block (16 tokens each); the results are
// (k[d][t], k[d+1][t]) and (k[d+2][t], k[d+3][t]) for t = 0..15, as `vpermw` makes them from a
// bf16 block. V: rows t and t+1 (index bit 6: the second row), 32 head dims a call (h: which
// half of a 64-code register), in the order the bf16 path's `vpunpck{l,h}wd` gives.
struct PairOrders {
  alignas(64) uint8_t k[64], v[2][64];
  PairOrders() {
    for (int L = 0; L < 4; ++L)
      for (int j = 0; j < 8; ++j) {
        const int t = (8 * L + j) / 2, r = j % 2;
        k[16 * L + j] = static_cast<uint8_t>(r * 16 + t);
        k[16 * L + 8 + j] = static_cast<uint8_t>((2 + r) * 16 + t);
        for (int h = 0; h < 2; ++h) {
          v[h][16 * L + j] = static_cast<uint8_t>(r * 64 + 32 * h + 8 * L + j / 2);
          v[h][16 * L + 8 + j] = static_cast<uint8_t>(r * 64 + 32 * h + 8 * L + 4 + j / 2);
        }
      }
  }
};

// The pieces of one block's work that the decode kernel (one query row) and the prefill kernel
// (a tile of rows sharing each K/V block) both run, so that a row's arithmetic is the same code
// in both: its bits do not depend on which kernel computed it, nor on the tile around it.
//
// K's words for rows d = 4r..4r+3 of a transposed block: (k[d][t], k[d+1][t]) and
// (k[d+2][t], k[d+3][t]) for t = 0..15.
template <typename K>
inline void k_words(const K* kt, int r, __m512i perm, __m512i kord, const Bf16Table<K>& tab, __m512i& k0,
                    __m512i& k1) {
  if constexpr (!std::is_same_v<K, c10::BFloat16>) {
    const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(kt + r * 64));
    bf16_words<K>(_mm512_permutexvar_epi8(kord, x), tab, k0, k1);
  } else {
    const uint16_t* kw = reinterpret_cast<const uint16_t*>(kt) + r * 64;
    k0 = _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(reinterpret_cast<const void*>(kw)));
    k1 = _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(reinterpret_cast<const void*>(kw + 32)));
  }
}

// V's rows t and t + 1 of a block [16][kD] paired (zeros for t + 1 where !second: never the
// cache's stale values), head dims in the unpack's order: kD / 32 chunks of lo and hi words.
template <typename K, int kD>
inline void v_words(const K* vb, int64_t t, bool second, __m512i vord0, __m512i vord1, const Bf16Table<K>& tab,
                    __m512i* vl, __m512i* vh) {
  if constexpr (!std::is_same_v<K, c10::BFloat16>) {
    for (int z = 0; z < kD / 64; ++z) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(vb + t * kD + z * 64));
      const __m512i b = second ? _mm512_loadu_si512(reinterpret_cast<const void*>(vb + (t + 1) * kD + z * 64))
                               : _mm512_setzero_si512();  // code 0 is +0 in every format
      bf16_words<K>(_mm512_permutex2var_epi8(a, vord0, b), tab, vl[2 * z], vh[2 * z]);
      bf16_words<K>(_mm512_permutex2var_epi8(a, vord1, b), tab, vl[2 * z + 1], vh[2 * z + 1]);
    }
  } else {
    const uint16_t* v0 = reinterpret_cast<const uint16_t*>(vb) + t * kD;
    for (int c = 0; c < kD / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + c * 32));
      const __m512i b = second ? _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + kD + c * 32))
                               : _mm512_setzero_si512();
      vl[c] = _mm512_unpacklo_epi16(a, b), vh[c] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

// One head's softmax over a block, in registers: its scores (the two dot-product accumulators,
// times K's scale) at the live positions, the running max m and per-lane sum lv updated, the
// head's accumulated P.V rescaled when the max moves (else the factor would be exp16(0) = 1
// exactly: skipped), and the block's probabilities (times V's per-token scales for int8) as
// bf16 pairs for the P.V dot products.
template <typename K, int kC>
inline void block_softmax(__m512 sv, __m512 sw, __m512 ksc, __m512 vsc, __mmask16 live, float& m, __m512& lv,
                          __m512* lo, __m512* hi, uint32_t* pp) {
  const __m512 sc16 = _mm512_mask_blend_ps(live, _mm512_set1_ps(kNegBig), _mm512_mul_ps(_mm512_add_ps(sv, sw), ksc));
  const __m512 mv = _mm512_set1_ps(m);
  __m512 p;
  if (_mm512_cmp_ps_mask(sc16, mv, _CMP_GT_OQ) == 0) {  // no new maximum
    p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc16, mv)));
    lv = _mm512_add_ps(lv, p);
  } else {  // a new maximum: rescale what came before
    const float mx = _mm512_reduce_max_ps(sc16);
    const __m512 mxv = _mm512_set1_ps(mx);
    const __m512 cv = exp16(_mm512_sub_ps(mv, mxv));
    p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc16, mxv)));
    lv = _mm512_fmadd_ps(lv, cv, p);
    for (int c = 0; c < kC; ++c) lo[c] = _mm512_mul_ps(lo[c], cv), hi[c] = _mm512_mul_ps(hi[c], cv);
    m = mx;
  }
  if constexpr (kPerToken<K>) p = _mm512_mul_ps(p, vsc);
  _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(p));
}

// A block's K and V scales as the softmax takes them: K's folded scale, times int8's per-token
// scales (V's are applied to the probabilities).
template <typename K>
inline void block_scales(const Scales& sc, int64_t h, int64_t NB, int64_t id, float fscale, __m512& ksc, __m512& vsc) {
  constexpr int kBS = 16;
  ksc = _mm512_set1_ps(fscale), vsc = _mm512_set1_ps(1.f);
  if constexpr (kPerToken<K>) {  // int8: the tokens' own scales
    alignas(64) float ks[kBS], vs[kBS];
    widen16(sc.k + (h * NB + id) * kBS, ks);
    widen16(sc.v + (h * NB + id) * kBS, vs);
    ksc = _mm512_mul_ps(ksc, _mm512_load_ps(ks)), vsc = _mm512_load_ps(vs);
  }
}

// A head's result after its last block: normalised (with a sink, when the row is whole) into
// the output row, or, for one part of a split row, into the part's buffer with its log-sum-exp.
// In chunk c, 128-bit lane L of `lo` holds head_dim 32c + 8L + 0..3 and of `hi` 32c + 8L + 4..7
// (the unpack's order, undone here).
template <typename T, int kD>
inline void finish_head(const __m512* lo, const __m512* hi, float m, __m512 lv, const float* sink, float v_layer,
                        T* orow, float* part, float* lse) {
  const float l = _mm512_reduce_add_ps(lv);
  const float inv = v_layer * normaliser(m, l, sink);
  if (part != nullptr) *lse = m + std::log(l);
  for (int c = 0; c < kD / 32; ++c) {
    alignas(64) float a[16], b[16];
    _mm512_store_ps(a, _mm512_mul_ps(lo[c], _mm512_set1_ps(inv)));
    _mm512_store_ps(b, _mm512_mul_ps(hi[c], _mm512_set1_ps(inv)));
    for (int L = 0; L < 4; ++L)
      for (int i = 0; i < 4; ++i) {
        emit(orow, part, 32 * c + 8 * L + i, a[4 * L + i]);
        emit(orow, part, 32 * c + 8 * L + 4 + i, b[4 * L + i]);
      }
  }
}

// The index vectors both kernels use: vpermw's (lane pair t takes word t, row d, and word 16 + t,
// row d + 1) and the byte orders of PairOrders.
struct WordOrders {
  __m512i perm, kord, vord0, vord1;
  WordOrders() {
    static const PairOrders orders;
    alignas(64) int16_t idx[32];
    for (int t = 0; t < 16; ++t) idx[2 * t] = static_cast<int16_t>(t), idx[2 * t + 1] = static_cast<int16_t>(16 + t);
    perm = _mm512_load_si512(reinterpret_cast<const void*>(idx));
    kord = _mm512_load_si512(orders.k), vord0 = _mm512_load_si512(orders.v[0]), vord1 = _mm512_load_si512(orders.v[1]);
  }
};

// A query row's kG heads as bf16 pairs (the dot products' operand).
template <typename T, int kD, int kG>
inline void query_pairs(const T* qrow, uint32_t (*qp)[kD / 2]) {
  alignas(64) float qf[kG][kD];
  for (int g = 0; g < kG; ++g)
    for (int d = 0; d < kD; ++d) qf[g][d] = load_f(qrow[g * kD + d]);
  for (int g = 0; g < kG; ++g) bf16_pairs(qf[g], kD, qp[g]);
}

template <typename T, typename K, int kD, int kG>
void decode_pair_group_bf16(const T* qrow, const K* kp, const K* vp, const int32_t* table,
                            int64_t n, int64_t start, int64_t, int64_t NB, int64_t h, int64_t, int64_t,
                            float fscale, float, const float* sink, const Scales& sc, float*, float*, float*,
                            float*, float*, float*, float*, T* orow, float* part, float* lse) {
  constexpr int kBS = 16, kC = kD / 32;  // kC: 32-wide chunks of head_dim per V row
  static_assert(kD % 64 == 0, "head_dim a multiple of 64");
  static const Bf16Table<K> tab;
  const WordOrders wo;
  alignas(64) uint32_t qp[kG][kD / 2];
  query_pairs<T, kD, kG>(qrow, qp);
  __m512 lo[kG][kC], hi[kG][kC];  // head_dim permuted: see finish_head
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) lo[g][c] = _mm512_setzero_ps(), hi[g][c] = _mm512_setzero_ps();
  float m[kG];
  __m512 lv[kG];  // the running sum, per lane
  for (int g = 0; g < kG; ++g) m[g] = kNegBig, lv[g] = _mm512_setzero_ps();
  prefetch_ahead<K>(kp, vp, table, start / kBS - 1, n, h, NB, kD, sc);  // the second block
  for (int64_t blk = start / kBS; blk * kBS < n; ++blk) {
    const int64_t id = table[blk];
    const int64_t cnt = std::min<int64_t>(kBS, n - blk * kBS);
    const K* kt = kp + (h * NB + id) * kD * kBS;  // [kD][kBS]
    const K* vb = vp + (h * NB + id) * kBS * kD;  // [kBS][kD]
    prefetch_ahead<K>(kp, vp, table, blk, n, h, NB, kD, sc);
    // Scores: rows d..d+3 at a time, two accumulators a head (even and odd pairs of rows) so
    // that consecutive `vdpbf16ps` do not wait on each other.
    __m512 sv[kG], sw[kG];
    for (int g = 0; g < kG; ++g) sv[g] = _mm512_setzero_ps(), sw[g] = _mm512_setzero_ps();
    for (int r = 0; r < kD / 4; ++r) {
      __m512i k0, k1;
      k_words<K>(kt, r, wo.perm, wo.kord, tab, k0, k1);
      for (int g = 0; g < kG; ++g) {
        sv[g] = dpbf16(sv[g], k0, _mm512_set1_epi32(static_cast<int>(qp[g][2 * r])));
        sw[g] = dpbf16(sw[g], k1, _mm512_set1_epi32(static_cast<int>(qp[g][2 * r + 1])));
      }
    }
    __m512 ksc, vsc;
    block_scales<K>(sc, h, NB, id, fscale, ksc, vsc);
    // The block's live positions (before `cnt`, from the window's start) as a mask.
    const int64_t skip = std::max<int64_t>(0, start - blk * kBS);
    const __mmask16 live = static_cast<__mmask16>(((1u << cnt) - 1u) & ~((1u << skip) - 1u));
    alignas(64) uint32_t pp[kG][kBS / 2];
    for (int g = 0; g < kG; ++g) block_softmax<K, kC>(sv[g], sw[g], ksc, vsc, live, m[g], lv[g], lo[g], hi[g], pp[g]);
    for (int64_t t = 0; t < cnt; t += 2) {
      __m512i vl[kC], vh[kC];  // rows t and t + 1 paired
      v_words<K, kD>(vb, t, t + 1 < cnt, wo.vord0, wo.vord1, tab, vl, vh);
      for (int g = 0; g < kG; ++g) {
        const __m512i pb = _mm512_set1_epi32(static_cast<int>(pp[g][t / 2]));
        for (int c = 0; c < kC; ++c) {
          lo[g][c] = dpbf16(lo[g][c], vl[c], pb);
          hi[g][c] = dpbf16(hi[g][c], vh[c], pb);
        }
      }
    }
  }
  for (int g = 0; g < kG; ++g)
    finish_head<T, kD>(lo[g], hi[g], m[g], lv[g], sink ? sink + g : nullptr, sc.v_layer, orow + g * kD,
                       part ? part + g * kD : nullptr, lse ? lse + g : nullptr);
}

// Prefill: a tile of up to kTileRows consecutive query rows of one sequence and one kv head,
// row i attending to the first n0 + i positions (causal; no window, chunk, sink or soft-cap).
// Each K/V block is turned into dot-product words once for the whole tile, then every row that
// reaches it takes exactly the decode kernel's steps over it (block_softmax and the same
// dot-product chains, in the same order), and a row longer than kPartBlocks blocks is cut into
// the same parts, finished and merged as decode does. So a prompt token's attention has the bits
// it would have as a decode row, whatever its chunk, tile or batch (kernels/batch_invariant.py),
// while each block is read once per tile instead of once per row. Rows past a shorter row's end
// in a block hold real (written) values, which its probabilities of exactly 0 multiply into +-0:
// the accumulators, never -0, do not change.
constexpr int kTileRows = 16;

template <int kD, int kG>
struct alignas(64) TileRow {
  __m512 lo[kG][kD / 32], hi[kG][kD / 32], lv[kG];
  float m[kG];
  alignas(64) uint32_t qp[kG][kD / 2];
};

template <typename T, typename K, int kD, int kG>
void prefill_tile_bf16(const T* q, int64_t q_stride, const K* kp, const K* vp, const int32_t* table, int64_t n0,
                       int64_t R, int64_t NB, int64_t h, float fscale, const Scales& sc, T* out, int64_t out_stride) {
  constexpr int kBS = 16, kC = kD / 32;
  static const Bf16Table<K> tab;
  thread_local std::vector<TileRow<kD, kG>> rows;  // each row's running state, in L1
  thread_local std::vector<float> parts, lses;     // a split row's finished parts
  const WordOrders wo;
  const int64_t last = n0 + R - 1;                      // the tile's longest row
  const int64_t nblk = (last - 1) / kBS + 1;
  const int64_t max_parts = (nblk - 1) / kPartBlocks + 1;  // the longest row's parts
  rows.resize(R);
  if (max_parts > 1) parts.resize(R * max_parts * kG * kD), lses.resize(R * max_parts * kG);
  for (int64_t i = 0; i < R; ++i) query_pairs<T, kD, kG>(q + i * q_stride, rows[i].qp);
  alignas(64) __m512i kw[kD / 4][2], vw[kBS / 2][2][kC];
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int64_t p = blk / kPartBlocks;
    if (blk % kPartBlocks == 0)
      for (int64_t i = 0; i < R; ++i) {  // a new part: fresh running state
        TileRow<kD, kG>& s = rows[i];
        for (int g = 0; g < kG; ++g) {
          for (int c = 0; c < kC; ++c) s.lo[g][c] = _mm512_setzero_ps(), s.hi[g][c] = _mm512_setzero_ps();
          s.m[g] = kNegBig, s.lv[g] = _mm512_setzero_ps();
        }
      }
    const int64_t id = table[blk];
    const K* kt = kp + (h * NB + id) * kD * kBS;
    const K* vb = vp + (h * NB + id) * kBS * kD;
    const int64_t cnt_max = std::min<int64_t>(kBS, last - blk * kBS);
    for (int r = 0; r < kD / 4; ++r) k_words<K>(kt, r, wo.perm, wo.kord, tab, kw[r][0], kw[r][1]);
    for (int64_t t = 0; t < cnt_max; t += 2) v_words<K, kD>(vb, t, t + 1 < cnt_max, wo.vord0, wo.vord1, tab, vw[t / 2][0], vw[t / 2][1]);
    __m512 ksc, vsc;
    block_scales<K>(sc, h, NB, id, fscale, ksc, vsc);
    // Rows that reach this block: those from the first whose length passes its start.
    const int64_t first = std::max<int64_t>(0, blk * kBS + 1 - n0);
    for (int64_t i = first; i < R; ++i) {
      TileRow<kD, kG>& s = rows[i];
      const int64_t n = n0 + i, cnt = std::min<int64_t>(kBS, n - blk * kBS);
      __m512 lo[kG][kC], hi[kG][kC], sv[kG], sw[kG];
      for (int g = 0; g < kG; ++g) {
        for (int c = 0; c < kC; ++c) lo[g][c] = s.lo[g][c], hi[g][c] = s.hi[g][c];
        sv[g] = _mm512_setzero_ps(), sw[g] = _mm512_setzero_ps();
      }
      for (int r = 0; r < kD / 4; ++r)
        for (int g = 0; g < kG; ++g) {
          sv[g] = dpbf16(sv[g], kw[r][0], _mm512_set1_epi32(static_cast<int>(s.qp[g][2 * r])));
          sw[g] = dpbf16(sw[g], kw[r][1], _mm512_set1_epi32(static_cast<int>(s.qp[g][2 * r + 1])));
        }
      const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1u);
      alignas(64) uint32_t pp[kG][kBS / 2];
      for (int g = 0; g < kG; ++g) block_softmax<K, kC>(sv[g], sw[g], ksc, vsc, live, s.m[g], s.lv[g], lo[g], hi[g], pp[g]);
      for (int64_t t = 0; t < cnt; t += 2)
        for (int g = 0; g < kG; ++g) {
          const __m512i pb = _mm512_set1_epi32(static_cast<int>(pp[g][t / 2]));
          for (int c = 0; c < kC; ++c) {
            lo[g][c] = dpbf16(lo[g][c], vw[t / 2][0][c], pb);
            hi[g][c] = dpbf16(hi[g][c], vw[t / 2][1][c], pb);
          }
        }
      const int64_t row_parts = ((n - 1) / kBS) / kPartBlocks + 1;
      const bool ends = blk == (n - 1) / kBS || blk % kPartBlocks == kPartBlocks - 1;  // its part's last block
      for (int g = 0; g < kG; ++g) {
        if (ends) {
          const int64_t at = (i * max_parts + p) * kG + g;
          finish_head<T, kD>(lo[g], hi[g], s.m[g], s.lv[g], nullptr, sc.v_layer, out + i * out_stride + g * kD,
                             row_parts > 1 ? parts.data() + at * kD : nullptr, row_parts > 1 ? lses.data() + at : nullptr);
        }
        for (int c = 0; c < kC; ++c) s.lo[g][c] = lo[g][c], s.hi[g][c] = hi[g][c];
      }
    }
  }
  thread_local std::vector<float> w;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t row_parts = ((n0 + i - 1) / kBS) / kPartBlocks + 1;
    if (row_parts > 1)
      merge_parts<T>(parts.data() + i * max_parts * kG * kD, lses.data() + i * max_parts * kG, row_parts, kG, kD,
                     nullptr, out + i * out_stride, w);
  }
}
// The many-heads kernel (decode_pair_wide) over a bf16 cache with the bf16 dot products, where
// head_dim is a multiple of 32 (DeepSeek's 576, Gemma's 256, 96): the group kernels' steps
// (k_words, the softmax of block_softmax, V rows paired by unpacking) with the accumulators of
// P.V in memory, a head_dim-chunk of 32 and up to 8 heads in registers at a time, since 16-128
// heads x 576 dims do not fit; K's words are made once per chunk of heads. The query and the
// probabilities meet the cache rounded to bf16, as in the group kernels.
inline bool wide_softmax_bf16(__m512 sv, __m512 sw, float fscale, __mmask16 live, float& m, __m512& lv, __m512& cv,
                              uint32_t* pp) {
  const __m512 sc16 = _mm512_mask_blend_ps(live, _mm512_set1_ps(kNegBig), _mm512_mul_ps(_mm512_add_ps(sv, sw), _mm512_set1_ps(fscale)));
  const __m512 mv = _mm512_set1_ps(m);
  __m512 p;
  bool moved = false;
  if (_mm512_cmp_ps_mask(sc16, mv, _CMP_GT_OQ) == 0) {
    p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc16, mv)));
    lv = _mm512_add_ps(lv, p);
  } else {
    const float mx = _mm512_reduce_max_ps(sc16);
    const __m512 mxv = _mm512_set1_ps(mx);
    cv = exp16(_mm512_sub_ps(mv, mxv));
    p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc16, mxv)));
    lv = _mm512_fmadd_ps(lv, cv, p);
    m = mx;
    moved = true;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(p));
  return moved;
}

// One block for kGC heads from g0: scores, softmax (m, lv updated), P.V into acc.
template <int kGC>
inline void wide_block_bf16(const uint32_t* qp, int64_t D, const c10::BFloat16* kt, const c10::BFloat16* vb, int64_t cnt,
                            __mmask16 live, float fscale, const WordOrders& wo, const Bf16Table<c10::BFloat16>& tab,
                            float* m, float* lvs, float* acc) {
  __m512 sv[kGC], sw[kGC];
  for (int g = 0; g < kGC; ++g) sv[g] = _mm512_setzero_ps(), sw[g] = _mm512_setzero_ps();
  const int64_t half = D / 2;
  for (int r = 0; r < D / 4; ++r) {
    __m512i k0, k1;
    k_words<c10::BFloat16>(kt, r, wo.perm, wo.kord, tab, k0, k1);
    for (int g = 0; g < kGC; ++g) {
      sv[g] = dpbf16(sv[g], k0, _mm512_set1_epi32(static_cast<int>(qp[g * half + 2 * r])));
      sw[g] = dpbf16(sw[g], k1, _mm512_set1_epi32(static_cast<int>(qp[g * half + 2 * r + 1])));
    }
  }
  alignas(64) uint32_t pp[kGC][8];
  __m512 cv[kGC];
  bool moved[kGC];
  for (int g = 0; g < kGC; ++g) {
    __m512 lv = _mm512_loadu_ps(lvs + g * 16);
    moved[g] = wide_softmax_bf16(sv[g], sw[g], fscale, live, m[g], lv, cv[g], pp[g]);
    _mm512_storeu_ps(lvs + g * 16, lv);
  }
  const uint16_t* v0 = reinterpret_cast<const uint16_t*>(vb);
  for (int64_t c = 0; c < D / 32; ++c) {
    __m512 lo[kGC], hi[kGC];
    for (int g = 0; g < kGC; ++g) {
      lo[g] = _mm512_loadu_ps(acc + g * D + c * 32), hi[g] = _mm512_loadu_ps(acc + g * D + c * 32 + 16);
      if (moved[g]) lo[g] = _mm512_mul_ps(lo[g], cv[g]), hi[g] = _mm512_mul_ps(hi[g], cv[g]);
    }
    for (int64_t t = 0; t < cnt; t += 2) {
      const __m512i a = _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + t * D + c * 32));
      const __m512i b = t + 1 < cnt ? _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + (t + 1) * D + c * 32))
                                    : _mm512_setzero_si512();  // never the cache's stale values
      const __m512i vl = _mm512_unpacklo_epi16(a, b), vh = _mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < kGC; ++g) {
        const __m512i pb = _mm512_set1_epi32(static_cast<int>(pp[g][t / 2]));
        lo[g] = dpbf16(lo[g], vl, pb);
        hi[g] = dpbf16(hi[g], vh, pb);
      }
    }
    for (int g = 0; g < kGC; ++g) {
      _mm512_storeu_ps(acc + g * D + c * 32, lo[g]);
      _mm512_storeu_ps(acc + g * D + c * 32 + 16, hi[g]);
    }
  }
}

template <typename T>
void decode_pair_wide_bf16(const T* qrow, const c10::BFloat16* kp, const c10::BFloat16* vp, const int32_t* table,
                           int64_t n, int64_t start, int64_t G, int64_t NB, int64_t h, int64_t, int64_t D, float fscale,
                           float, const float* sink, const Scales& sc, float* qf, float* acc, float*, float*, float* s,
                           float* m, float*, T* orow, float* part, float* lse) {
  constexpr int64_t kBS = 16;
  static const Bf16Table<c10::BFloat16> tab;
  const WordOrders wo;
  uint32_t* qp = reinterpret_cast<uint32_t*>(qf);  // [G][D / 2] bf16 pairs (qf holds G * D floats)
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) acc[d] = load_f(qrow[g * D + d]);
    bf16_pairs(acc, static_cast<int>(D), qp + g * (D / 2));
  }
  for (int64_t j = 0; j < G * D; ++j) acc[j] = 0.f;
  for (int64_t j = 0; j < G * kBS; ++j) s[j] = 0.f;  // each head's running sum, per lane
  for (int64_t g = 0; g < G; ++g) m[g] = kNegBig;
  prefetch_ahead(kp, vp, table, start / kBS - 1, n, h, NB, D, sc);  // the second block
  for (int64_t blk = start / kBS; blk * kBS < n; ++blk) {
    const int64_t id = table[blk];
    const int64_t cnt = std::min(kBS, n - blk * kBS);
    prefetch_ahead(kp, vp, table, blk, n, h, NB, D, sc);
    const c10::BFloat16* kt = kp + (h * NB + id) * D * kBS;  // [D][16]
    const c10::BFloat16* vb = vp + (h * NB + id) * kBS * D;  // [16][D]
    const int64_t skip = std::max<int64_t>(0, start - blk * kBS);
    const __mmask16 live = static_cast<__mmask16>(((1u << cnt) - 1u) & ~((1u << skip) - 1u));
    for (int64_t g0 = 0; g0 < G;) {
      const int64_t rest = G - g0;
      const int gc = rest >= 8 ? 8 : rest >= 4 ? 4 : rest >= 2 ? 2 : 1;
      const uint32_t* qg = qp + g0 * (D / 2);
      float* mg = m + g0;
      float* lg = s + g0 * kBS;
      float* ag = acc + g0 * D;
      switch (gc) {
        case 8: wide_block_bf16<8>(qg, D, kt, vb, cnt, live, fscale, wo, tab, mg, lg, ag); break;
        case 4: wide_block_bf16<4>(qg, D, kt, vb, cnt, live, fscale, wo, tab, mg, lg, ag); break;
        case 2: wide_block_bf16<2>(qg, D, kt, vb, cnt, live, fscale, wo, tab, mg, lg, ag); break;
        default: wide_block_bf16<1>(qg, D, kt, vb, cnt, live, fscale, wo, tab, mg, lg, ag); break;
      }
      g0 += gc;
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // lane order as finish_head undoes it
    const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(s + g * kBS));
    const float inv = sc.v_layer * normaliser(m[g], l, sink ? sink + g : nullptr);
    if (part != nullptr) lse[g] = m[g] + std::log(l);
    for (int64_t c = 0; c < D / 32; ++c) {
      alignas(64) float a[16], b[16];
      _mm512_store_ps(a, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c * 32), _mm512_set1_ps(inv)));
      _mm512_store_ps(b, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c * 32 + 16), _mm512_set1_ps(inv)));
      for (int L = 0; L < 4; ++L)
        for (int i = 0; i < 4; ++i) {
          emit(orow, part, g * D + 32 * c + 8 * L + i, a[4 * L + i]);
          emit(orow, part, g * D + 32 * c + 8 * L + 4 + i, b[4 * L + i]);
        }
    }
  }
}
#pragma GCC pop_options

// The CPU has AVX-512 BF16 and $TRIOLLM_CPU_ISA (the quantized kernels' override, for tests and
// A/B runs) is unset or "auto": any forced path means "as a CPU without it". Once per process.
bool bf16_dot_enabled() {
  static const bool enabled = [] {
    __builtin_cpu_init();
    const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                     __builtin_cpu_supports("avx512bf16");
    const char* forced = std::getenv("TRIOLLM_CPU_ISA");
    const bool free = forced == nullptr || *forced == '\0' || std::string(forced) == "auto";
    return cpu && free;
  }();
  return enabled;
}

// The same, for a quantized cache: also AVX-512 VBMI (the byte tables, `vpermi2b`).
bool quant_dot_enabled() {
  static const bool enabled = bf16_dot_enabled() && __builtin_cpu_supports("avx512vbmi");
  return enabled;
}

// The query heads per kv head that have instances of the grouped kernels (a register block per
// head): f(std::integral_constant<int, G>{}) for those, `other` for the rest.
template <typename R, typename F>
R by_group(int64_t G, F f, R other) {
  switch (G) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return other;
  }
}

template <typename T, typename K>
using PairFn = decltype(&decode_pair<T, K, 0, 0>);

template <typename T, typename K, int kD>
PairFn<T, K> group_instance(int64_t G) {
  const PairFn<T, K> generic = by_group<PairFn<T, K>>(
      G, [](auto g) { return &decode_pair_group<T, K, kD, decltype(g)::value>; }, &decode_pair<T, K, 16, kD>);
  if constexpr (std::is_same_v<K, c10::BFloat16> || kQuantized<K>) {
    if (kQuantized<K> ? quant_dot_enabled() : bf16_dot_enabled())
      return by_group<PairFn<T, K>>(
          G, [](auto g) { return &decode_pair_group_bf16<T, K, kD, decltype(g)::value>; }, generic);
  }
  return generic;
}

// A quantized cache's scales as the kernels take them (checked): int8's per-token fp16 scales,
// or fp8's layer scales, K's folded into `fscale` (the query's) and V's into the normalisation.
template <typename K>
Scales layer_scales(const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, int64_t KVH,
                    int64_t NB, int64_t BS, float& fscale) {
  Scales sc;
  if constexpr (kPerToken<K>) {
    TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf &&
                    k_scale->is_contiguous() && v_scale->is_contiguous() &&
                    k_scale->numel() == KVH * NB * BS && v_scale->numel() == KVH * NB * BS,
                "an int8 cache: k_scale and v_scale fp16 [kv_heads, num_blocks, block_size], contiguous");
    TORCH_CHECK(BS <= 64, "an int8 cache: block_size at most 64");
    sc.k = reinterpret_cast<const c10::Half*>(k_scale->data_ptr());
    sc.v = reinterpret_cast<const c10::Half*>(v_scale->data_ptr());
  } else if (k_scale || v_scale) {  // fp8: the layer's scales, folded out of the loops
    TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kFloat &&
                    v_scale->scalar_type() == at::kFloat && k_scale->numel() == 1 && v_scale->numel() == 1,
                "an fp8 cache: k_scale and v_scale are float32 [1]");
    fscale *= k_scale->data_ptr<float>()[0] / kRaw<K>;
    sc.v_layer = v_scale->data_ptr<float>()[0] / kRaw<K>;
  }
  return sc;
}

// One decode attention call's plan: the kernel for the shapes, and each row's tasks (its kv heads,
// a long row cut into parts) and part buffers, which depend on the rows' lengths only. `run`
// takes tasks until none are left, from any number of threads; `merge` then joins the split
// rows' parts. A layer's cache and scales come with each call (`Layer`): every layer of a step
// shares one plan (decoder.cpp's team stack).
template <typename T, typename K>
struct DecodeCall {
  struct Task {
    int64_t b, h, lo, hi, slot;  // positions [lo, hi); slot: the part's buffer, -1 for a whole row
  };
  struct Layer {
    const K* kp;
    const K* vp;
    float fscale;
    Scales sc;
  };
  int64_t B, H, D, KVH, NB, BS, G, M;
  const int32_t* tables;
  float scale, cap;
  const float* sinks;
  PairFn<T, K> pair = &decode_pair<T, K, 0, 0>;
  std::vector<Task> tasks;
  std::vector<int64_t> row_slot, row_parts;
  int64_t slots = 0;
  bool serial = false;  // small enough for one thread
  std::vector<float> part, lse;

  DecodeCall(int64_t B_, int64_t H_, int64_t D_, const at::Tensor& v_cache, const at::Tensor& block_tables,
             const at::Tensor& context_lens, double scale_, int64_t window, double softcap, const float* sinks_,
             int64_t chunk)
      : B(B_), H(H_), D(D_), KVH(v_cache.size(0)), NB(v_cache.size(1)), BS(v_cache.size(2)), G(H_ / KVH),
        M(block_tables.size(1)), tables(block_tables.data_ptr<int32_t>()), scale(static_cast<float>(scale_)),
        cap(static_cast<float>(softcap)), sinks(sinks_), row_slot(B_, -1), row_parts(B_, 1) {
    if (cap > 0.f) {
      pair = &decode_pair<T, K, 0, 0, true>;
      if (BS == 16 && D == 64) pair = &decode_pair<T, K, 16, 64, true>;
      if (BS == 16 && D == 128) pair = &decode_pair<T, K, 16, 128, true>;
    } else {
      if (BS == 16 && D == 64) pair = group_instance<T, K, 64>(G);
      if (BS == 16 && D == 128) pair = group_instance<T, K, 128>(G);
    }
    if (BS == 16 && D % 16 == 0 && D != 64 && D != 128) {
      pair = cap > 0.f ? &decode_pair_wide<T, K, true> : &decode_pair_wide<T, K, false>;
      if constexpr (std::is_same_v<K, c10::BFloat16>) {
        if (cap <= 0.f && D % 32 == 0 && bf16_dot_enabled()) pair = &decode_pair_wide_bf16<T>;
      }
    }
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    auto first = [&](int64_t n) {  // the first position a row of length n attends
      int64_t start = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      if (chunk > 0) start = std::max<int64_t>(start, (n - 1) / chunk * chunk);
      return start;
    };
    // A long row is cut into parts of kPartBlocks blocks, each part its own task, merged after by
    // the parts' log-sum-exps (flash decoding's split): at batch 1 a model with 2-8 kv heads has
    // only that many (row, kv head) pairs to spread over the threads, and one pair's 8k-token
    // context is all the work. The cut depends on the row's own length only, never on the batch
    // or the thread count, so a row's bits stay the same in any batch (kernels/batch_invariant.py);
    // a row within one part runs exactly as before, normalised in place.
    tasks.reserve(B * KVH);
    int64_t total_tokens = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = lens[b], start = first(n), fb = start / BS;
      total_tokens += n - start;
      const int64_t parts = ((n - 1) / BS - fb) / kPartBlocks + 1;
      if (parts == 1) {
        for (int64_t h = 0; h < KVH; ++h) tasks.push_back({b, h, start, n, -1});
        continue;
      }
      row_slot[b] = slots, row_parts[b] = parts;
      for (int64_t h = 0; h < KVH; ++h)
        for (int64_t p = 0; p < parts; ++p)
          tasks.push_back({b, h, p == 0 ? start : (fb + p * kPartBlocks) * BS,
                           std::min(n, (fb + (p + 1) * kPartBlocks) * BS), slots + h * parts + p});
      slots += KVH * parts;
    }
    part.resize(slots * G * D), lse.resize(slots * G);
    // Small batches run on the calling thread: a pool wake-up costs more than the work.
    serial = total_tokens * KVH * D < (1 << 16);
  }

  // A layer's cache and scales (checked).
  Layer layer(const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale) const {
    Layer l{k_cache.data_ptr<K>(), v_cache.data_ptr<K>(), scale, {}};
    l.sc = layer_scales<K>(k_scale, v_scale, KVH, NB, BS, l.fscale);
    return l;
  }

  // Tasks as they come free, in order (the caller sorts rows longest first), not in fixed halves,
  // which left one thread with the long rows; each task writes only its own output or part, so
  // which thread takes it changes no bit.
  void run(const Layer& l, const T* qp, T* op, TaskCounter& counter) {
    std::vector<float> qf(G * D), acc(G * D), kbuf(D * BS), vbuf(BS * D), s(G * BS);
    std::vector<float> m(G), lsum(G);
    const Task* all = tasks.data();  // read once: the loop touches only the counter's line
    const int64_t n = static_cast<int64_t>(tasks.size());
    float* parts = part.data();
    float* lses = lse.data();
    for (int64_t i = counter.take(); i < n; i = counter.take()) {
      const Task& t = all[i];
      const bool whole = t.slot < 0;
      pair(qp + (t.b * H + t.h * G) * D, l.kp, l.vp, tables + t.b * M, t.hi, t.lo, G, NB, t.h, BS, D, l.fscale, cap,
           whole && sinks ? sinks + t.h * G : nullptr, l.sc, qf.data(), acc.data(), kbuf.data(), vbuf.data(),
           s.data(), m.data(), lsum.data(), op + (t.b * H + t.h * G) * D, whole ? nullptr : parts + t.slot * G * D,
           whole ? nullptr : lses + t.slot * G);
    }
  }

  // The merge of (row, kv head) pairs [begin, end) of B * KVH, parts in order (merge_parts).
  void merge(T* op, int64_t begin, int64_t end) {
    std::vector<float> w(kMaxParts);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, h = i % KVH;
      if (row_slot[b] < 0) continue;
      const int64_t base = row_slot[b] + h * row_parts[b];
      merge_parts<T>(part.data() + base * G * D, lse.data() + base * G, row_parts[b], G, D,
                     sinks ? sinks + h * G : nullptr, op + (b * H + h * G) * D, w);
    }
  }
};

template <typename T, typename K>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
            int64_t window, double softcap, const std::optional<at::Tensor>& k_scale,
            const std::optional<at::Tensor>& v_scale, const float* sinks, int64_t chunk,
            at::Tensor& out) {
  DecodeCall<T, K> call(q.size(0), q.size(1), q.size(2), v_cache, block_tables, context_lens, scale, window, softcap,
                        sinks, chunk);
  const auto layer = call.layer(k_cache, v_cache, k_scale, v_scale);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  TaskCounter counter;
  const int64_t n = static_cast<int64_t>(call.tasks.size());
  const int64_t workers = call.serial ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (workers <= 1) {
    call.run(layer, qp, op, counter);
  } else {
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { call.run(layer, qp, op, counter); });
  }
  if (call.slots == 0) return;
  const int64_t pairs = call.B * call.KVH;
  at::parallel_for(0, pairs, call.slots * call.G * call.D < (1 << 16) ? pairs : 1,
                   [&](int64_t begin, int64_t end) { call.merge(op, begin, end); });
}

template <typename T, typename K>
using TileFn = decltype(&prefill_tile_bf16<T, K, 64, 1>);

template <typename T, typename K, int kD>
TileFn<T, K> tile_instance(int64_t G) {
  return by_group<TileFn<T, K>>(
      G, [](auto g) { return &prefill_tile_bf16<T, K, kD, decltype(g)::value>; }, nullptr);
}

// The step's prefill chunks (paged_prefill_attention): tasks of one chunk's tile of rows and one
// kv head, the costliest first, taken by the threads as they come free (causal tiles differ in
// length; each task writes only its own rows, so the split does not change a bit).
template <typename T, typename K>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
             const at::Tensor& starts, const at::Tensor& contexts, double scale,
             const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = v_cache.size(0), NB = v_cache.size(1);
  const int64_t G = H / KVH, M = tables.size(1), N = contexts.numel();
  const T* qp = q.data_ptr<T>();
  const K* kp = k_cache.data_ptr<K>();
  const K* vp = v_cache.data_ptr<K>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* cp = contexts.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  float fscale = static_cast<float>(scale);
  const Scales sc = layer_scales<K>(k_scale, v_scale, KVH, NB, 16, fscale);
  const TileFn<T, K> fn = D == 64 ? tile_instance<T, K, 64>(G) : tile_instance<T, K, 128>(G);
  TORCH_CHECK(fn != nullptr, "paged_prefill_attention: no kernel for ", G, " query heads per kv head");
  struct Task {
    int64_t c, h, r0, R, cost;
  };
  std::vector<Task> tasks;
  for (int64_t c = 0; c < N; ++c) {
    const int64_t rows = sp[c + 1] - sp[c];
    TORCH_CHECK(rows >= 0 && cp[c] >= 0 && (cp[c] + rows + 15) / 16 <= M,
                "paged_prefill_attention: chunk ", c, "'s rows and context must fit its block-table row");
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int64_t R = std::min<int64_t>(kTileRows, rows - r0);
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({c, h, r0, R, R * (cp[c] + r0 + R)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t T_ = static_cast<int64_t>(tasks.size());
  TaskCounter counter;
  auto work = [&](int64_t, int64_t) {
    const Task* all = tasks.data();
    for (int64_t i = counter.take(); i < T_; i = counter.take()) {
      const Task& t = all[i];
      const int64_t row = sp[t.c] + t.r0;
      fn(qp + (row * H + t.h * G) * D, H * D, kp, vp, tp + t.c * M, cp[t.c] + t.r0 + 1, t.R, NB, t.h, fscale, sc,
         op + (row * H + t.h * G) * D, H * D);
    }
  };
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), T_);
  if (workers <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, workers, 1, work);
  }
}

bool is_quantized(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kChar;
}

// window: 0, or a sliding window of that many positions; softcap: 0, or the logit soft-cap;
// k_scale, v_scale: a quantized cache's (fp8: float32 [1] each; int8: fp16 per token);
// sinks: None, or float32 [H], a logit per query head; chunk: 0, or the chunk of positions.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window,
                                  double softcap, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  const std::optional<at::Tensor>& sinks, int64_t chunk) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(window >= 0, "window: ", window, " must be >= 1 (0: no window)");
  TORCH_CHECK(softcap >= 0, "softcap: ", softcap, " must be > 0 (0: no soft-capping)");
  TORCH_CHECK(chunk >= 0, "chunk: ", chunk, " must be >= 1 (0: no chunks)");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                         sinks->size(0) == q.size(1) && sinks->is_contiguous()),
              "sinks: float32 [num_heads], contiguous");
  TORCH_CHECK(q.dim() == 3 && v_cache.dim() == 4 && k_cache.dim() == 4 &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "q [B, H, hd], k cache [kv_heads, blocks, hd, block_size], v cache [kv_heads, "
              "blocks, block_size, hd]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() ||
                   (q.scalar_type() == at::kFloat &&
                    (k_cache.scalar_type() == at::kBFloat16 || is_quantized(k_cache.scalar_type())))),
              "q and the cache must have one dtype, or q float32 over a bfloat16, fp8 or int8 cache");
  TORCH_CHECK(q.size(2) == v_cache.size(3) && q.size(1) % v_cache.size(0) == 0,
              "head_dim must match and query heads be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens are int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "one block-table row and one length per query");
  auto qc = q.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto tc = block_tables.contiguous();
  auto lc = context_lens.contiguous();
  auto out = at::empty_like(qc);
  const float* sp = sinks ? sinks->data_ptr<float>() : nullptr;
  switch (kc.scalar_type()) {  // fp32 activations over a bf16 or quantized cache
    case at::kBFloat16:
      if (qc.scalar_type() == at::kBFloat16) break;
      decode<float, c10::BFloat16>(qc, kc, vc, tc, lc, scale, window, softcap, k_scale, v_scale, sp, chunk, out);
      return out;
    case at::kFloat8_e4m3fn:
      decode<float, c10::Float8_e4m3fn>(qc, kc, vc, tc, lc, scale, window, softcap, k_scale, v_scale, sp, chunk, out);
      return out;
    case at::kFloat8_e5m2:
      decode<float, c10::Float8_e5m2>(qc, kc, vc, tc, lc, scale, window, softcap, k_scale, v_scale, sp, chunk, out);
      return out;
    case at::kChar:
      decode<float, int8_t>(qc, kc, vc, tc, lc, scale, window, softcap, k_scale, v_scale, sp, chunk, out);
      return out;
    default:
      break;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    decode<scalar_t, scalar_t>(qc, kc, vc, tc, lc, scale, window, softcap, k_scale, v_scale, sp, chunk, out);
  });
  return out;
}

// Causal attention of a step's prefill chunks over the paged cache, each row's arithmetic the
// decode kernel's (prefill_tile_bf16). q [P, H, hd]: the chunks' rows in order, chunk c's rows
// [query_starts[c], query_starts[c + 1]) at positions context_lens[c] onwards (K/V of every
// row already written); block_tables [N, M] int32 cover each chunk's context and rows. Where
// `prefill_attention_supported` says so only: a bf16, fp8 or int8 cache under float32 queries
// (or bf16 over bf16), block size 16, head_dim 64 or 128, 1-4, 6, 7 or 8 query heads per kv
// head, and the CPU's bf16 dot products (no window, sink, chunk or soft-cap: the caller's).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_starts,
                                   const at::Tensor& context_lens, double scale,
                                   const std::optional<at::Tensor>& k_scale,
                                   const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && v_cache.dim() == 4 && k_cache.dim() == 4 &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2) &&
                  q.size(2) == v_cache.size(3) && q.size(1) % v_cache.size(0) == 0,
              "q [P, H, hd], k cache [kv_heads, blocks, hd, block_size], v cache [kv_heads, blocks, "
              "block_size, hd], query heads a multiple of kv heads");
  const at::ScalarType kt = k_cache.scalar_type();
  const bool quantized = is_quantized(kt);
  TORCH_CHECK(v_cache.scalar_type() == kt &&
                  ((q.scalar_type() == at::kFloat && (kt == at::kBFloat16 || quantized)) ||
                   (q.scalar_type() == at::kBFloat16 && kt == at::kBFloat16)),
              "paged_prefill_attention: float32 queries over a bfloat16, fp8 or int8 cache, or bfloat16 over bfloat16");
  TORCH_CHECK(v_cache.size(2) == 16 && (q.size(2) == 64 || q.size(2) == 128),
              "paged_prefill_attention: block_size 16 and head_dim 64 or 128");
  TORCH_CHECK(quantized ? quant_dot_enabled() : bf16_dot_enabled(),
              "paged_prefill_attention: this CPU has no bf16 dot products (decode_attention_dot)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_starts.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == context_lens.numel() && query_starts.numel() == context_lens.numel() + 1,
              "block_tables [N, M], query_starts [N + 1] and context_lens [N], int32");
  auto qc = q.contiguous();
  auto kc = k_cache.contiguous();
  auto vc = v_cache.contiguous();
  auto tc = block_tables.contiguous();
  auto sc = query_starts.contiguous();
  auto lc = context_lens.contiguous();
  TORCH_CHECK(sc.data_ptr<int32_t>()[0] == 0 && sc.data_ptr<int32_t>()[lc.numel()] == q.size(0),
              "query_starts run from 0 to q's rows");
  auto out = at::empty_like(qc);
  if (q.size(0) == 0) return out;
  switch (kt) {
    case at::kBFloat16:
      if (qc.scalar_type() == at::kBFloat16) {
        prefill<c10::BFloat16, c10::BFloat16>(qc, kc, vc, tc, sc, lc, scale, k_scale, v_scale, out);
      } else {
        prefill<float, c10::BFloat16>(qc, kc, vc, tc, sc, lc, scale, k_scale, v_scale, out);
      }
      break;
    case at::kFloat8_e4m3fn: prefill<float, c10::Float8_e4m3fn>(qc, kc, vc, tc, sc, lc, scale, k_scale, v_scale, out); break;
    case at::kFloat8_e5m2: prefill<float, c10::Float8_e5m2>(qc, kc, vc, tc, sc, lc, scale, k_scale, v_scale, out); break;
    default: prefill<float, int8_t>(qc, kc, vc, tc, sc, lc, scale, k_scale, v_scale, out); break;
  }
  return out;
}

// Rotary embedding of Q and K, and the K/V cache write, for the fused QKV projection of a
// batch of tokens: one call instead of a dozen small ops per layer (they dominate a batch-1
// step's overhead). qkv [T, (H + 2 KVH) * D]; cos and signed sin [T, D] (fp32 or qkv's dtype;
// rotate-half's sign folded into sin: out = x * cos + roll(x, D/2) * sin). K goes to
// k_cache[kvh][block][:, offset] (blocks transposed), V to v_cache[kvh][block][offset][:], with
// block, offset = slot / block_size, slot % block_size. Returns the rotated Q [T, H, D].
// A quantized cache gets codes as kernels/kv_quant.py writes them (`store_row`).

// One K or V row x[0..D) into the cache at dst[d * stride], as the cache's type holds it: fp8
// saturated after multiplying by `inv` (1 / the layer's scale); int8 with its fp16 scale
// absmax / 127 written to *row_scale and the codes rounded (half to even) from the rounded
// scale; otherwise rounded to K.
template <typename K>
void store_row(const float* x, int64_t D, K* dst, int64_t stride, float inv, c10::Half* row_scale) {
  if constexpr (std::is_same_v<K, int8_t>) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const c10::Half sh(amax * (1.f / 127.f));
    *row_scale = sh;
    const float sf = static_cast<float>(sh);
    const float r = sf > 0.f ? 1.f / sf : 0.f;
    for (int64_t d = 0; d < D; ++d)
      dst[d * stride] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] * r))));
  } else if constexpr (std::is_same_v<K, c10::Float8_e4m3fn> || std::is_same_v<K, c10::Float8_e5m2>) {
    constexpr float big = std::is_same_v<K, c10::Float8_e4m3fn> ? 448.f : 57344.f;
    for (int64_t d = 0; d < D; ++d) dst[d * stride] = K(std::min(big, std::max(-big, x[d] * inv)));
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d * stride] = store_f<K>(x[d]);
  }
}

template <typename T, typename C, typename K>
void rotary_write(const T* qkv, const C* cos, const C* sin, K* kc, K* vc, const int64_t* slots,
                  T* q_out, int64_t n_tokens, int64_t H, int64_t KVH, int64_t D, int64_t NB,
                  int64_t BS, float k_inv = 1.f, float v_inv = 1.f, c10::Half* k_rows = nullptr,
                  c10::Half* v_rows = nullptr) {
  const int64_t half = D / 2, row = (H + 2 * KVH) * D;
  // A prompt chunk's tokens in parallel (each writes its own slot; the split changes no bit), a
  // decode step's few on the calling thread.
  at::parallel_for(0, n_tokens, n_tokens * row < (1 << 14) ? n_tokens : 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* x = qkv + t * row;
      const C* ct = cos + t * D;
      const C* st = sin + t * D;
      const int64_t block = slots[t] / BS, off = slots[t] % BS;
      for (int64_t hh = 0; hh < H + KVH; ++hh) {
        const T* xh = x + hh * D;
        float rot[512];
        for (int64_t d = 0; d < D; ++d) {
          const int64_t r = d < half ? d + half : d - half;
          rot[d] = load_f(xh[d]) * load_f(ct[d]) + load_f(xh[r]) * load_f(st[d]);
        }
        if (hh < H) {
          T* qh = q_out + (t * H + hh) * D;
          for (int64_t d = 0; d < D; ++d) qh[d] = store_f<T>(rot[d]);
        } else {
          K* kb = kc + ((hh - H) * NB + block) * D * BS;  // [D][BS]
          const int64_t row = ((hh - H) * NB + block) * BS + off;
          store_row<K>(rot, D, kb + off, BS, k_inv, k_rows ? k_rows + row : nullptr);
        }
      }
      for (int64_t hh = 0; hh < KVH; ++hh) {
        const T* vh = x + (H + KVH + hh) * D;
        const int64_t row = (hh * NB + block) * BS + off;
        float vf[512];
        for (int64_t d = 0; d < D; ++d) vf[d] = load_f(vh[d]);
        store_row<K>(vf, D, vc + row * D, 1, v_inv, v_rows ? v_rows + row : nullptr);
      }
    }
  });
}

at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                           int64_t num_heads, int64_t num_kv_heads,
                           const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  const int64_t n = qkv.size(0);
  const int64_t KVH = v_cache.size(0), NB = v_cache.size(1), BS = v_cache.size(2),
                D = v_cache.size(3);
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "qkv must be contiguous [T, (H + 2 * KVH) * head_dim]");
  TORCH_CHECK(num_kv_heads == KVH && D <= 512 && D % 2 == 0, "kv heads / head_dim mismatch");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * D &&
                  sin.numel() == n * D && cos.scalar_type() == sin.scalar_type(),
              "cos and sin must be contiguous [T, head_dim] of one dtype");
  const bool mixed = qkv.scalar_type() == at::kFloat &&
                     (k_cache.scalar_type() == at::kBFloat16 || is_quantized(k_cache.scalar_type()));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  (k_cache.scalar_type() == qkv.scalar_type() || mixed) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.size(2) == D &&
                  k_cache.size(3) == BS,
              "k cache [kv_heads, blocks, head_dim, block_size], v cache [kv_heads, blocks, "
              "block_size, head_dim], contiguous, in qkv's dtype (or bfloat16, fp8 or int8 under "
              "float32 qkv)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slots: int64 [T]");
  auto q = at::empty({n, num_heads, D}, qkv.options());
  if (mixed) {  // fp32 activations over a bf16 or quantized cache: K and V rounded once, here
    TORCH_CHECK(cos.scalar_type() == at::kFloat, "cos/sin: fp32 for fp32 qkv");
    const float* qp = qkv.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    float* qo = q.data_ptr<float>();
    switch (k_cache.scalar_type()) {
      case at::kChar: {
        TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf &&
                        k_scale->is_contiguous() && v_scale->is_contiguous() &&
                        k_scale->numel() == KVH * NB * BS && v_scale->numel() == KVH * NB * BS,
                    "an int8 cache: k_scale and v_scale fp16 [kv_heads, num_blocks, block_size], contiguous");
        rotary_write<float, float, int8_t>(
            qp, cp, sp, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), sl, qo, n, num_heads, KVH, D, NB, BS,
            1.f, 1.f, reinterpret_cast<c10::Half*>(k_scale->data_ptr()), reinterpret_cast<c10::Half*>(v_scale->data_ptr()));
        return q;
      }
      case at::kFloat8_e4m3fn:
      case at::kFloat8_e5m2: {
        TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kFloat &&
                        v_scale->scalar_type() == at::kFloat && k_scale->numel() == 1 && v_scale->numel() == 1,
                    "an fp8 cache: k_scale and v_scale are float32 [1]");
        const float ki = 1.f / k_scale->data_ptr<float>()[0], vi = 1.f / v_scale->data_ptr<float>()[0];
        if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
          rotary_write<float, float, c10::Float8_e4m3fn>(
              qp, cp, sp, k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>(), sl, qo, n,
              num_heads, KVH, D, NB, BS, ki, vi);
        } else {
          rotary_write<float, float, c10::Float8_e5m2>(
              qp, cp, sp, k_cache.data_ptr<c10::Float8_e5m2>(), v_cache.data_ptr<c10::Float8_e5m2>(), sl, qo, n,
              num_heads, KVH, D, NB, BS, ki, vi);
        }
        return q;
      }
      default:
        rotary_write<float, float, c10::BFloat16>(qp, cp, sp, k_cache.data_ptr<c10::BFloat16>(),
                                                  v_cache.data_ptr<c10::BFloat16>(), sl, qo, n, num_heads, KVH, D,
                                                  NB, BS);
        return q;
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_write", [&] {
    using T = scalar_t;
    if (cos.scalar_type() == at::kFloat) {
      rotary_write<T, float, T>(qkv.data_ptr<T>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                                slots.data_ptr<int64_t>(), q.data_ptr<T>(), n, num_heads, KVH, D,
                                NB, BS);
    } else {
      TORCH_CHECK(cos.scalar_type() == qkv.scalar_type(), "cos/sin: fp32 or qkv's dtype");
      rotary_write<T, T, T>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(),
                            k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), slots.data_ptr<int64_t>(),
                            q.data_ptr<T>(), n, num_heads, KVH, D, NB, BS);
    }
  });
  return q;
}

// SwiGLU on the fused gate/up projection: x [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I],
// computed in fp32 (one pass; torch's bf16 silu and mul were two passes with conversions). exp's
// argument is capped at 88 (e^88 < FLT_MAX): under -ffast-math the division is a reciprocal
// refined by a Newton step, which turns 1 / inf into NaN for a gate below -88 (silu -> -0 there).
template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t inter) {
  constexpr int64_t kChunk = 256;  // widened into fp32 buffers, so every loop vectorises
  at::parallel_for(0, rows, rows * inter < (1 << 15) ? rows : 1, [&](int64_t begin, int64_t end) {
    float gf[kChunk], uf[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i0 = 0; i0 < inter; i0 += kChunk) {
        const int64_t n = std::min(kChunk, inter - i0);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          gf[i] = load_f(g[i0 + i]);
          uf[i] = load_f(u[i0 + i]);
        }
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) gf[i] = gf[i] / (1.f + std::exp(std::min(-gf[i], 88.f))) * uf[i];
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i0 + i] = store_f<T>(gf[i]);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x: [T, 2 * intermediate]");
  auto xc = x.contiguous();
  const int64_t inter = x.size(1) / 2;
  auto out = at::empty({x.size(0), inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(xc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                                inter);
  });
  return out;
}

// RMSNorm over the last dimension in one pass per row, fp32 math, rounded once at the end
// (torch's CPU rms_norm for bf16 decomposes into ~8 ops with fp32 copies).
template <typename T>
void rms_norm_impl(const T* x, const T* w, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, rows * hidden < (1 << 16) ? rows : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(hidden), wf(hidden);
    for (int64_t i = 0; i < hidden; ++i) wf[i] = load_f(w[i]);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) {
        xf[i] = load_f(xr[i]);
        ss += xf[i] * xf[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = store_f<T>(xf[i] * inv * wf[i]);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  x.scalar_type() == weight.scalar_type(),
              "rms_norm: x [..., hidden], weight [hidden] of x's dtype");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t hidden = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), xc.numel() / hidden, hidden,
                            static_cast<float>(eps));
  });
  return out;
}

// StepAttention (cpu_kernels.h) over a cache of type K.
template <typename K>
class StepAttentionImpl final : public StepAttention {
 public:
  StepAttentionImpl(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens, int64_t B, int64_t H,
                    double scale, at::TensorList k_scales, at::TensorList v_scales)
      : call_(B, H, v_caches[0].size(3), v_caches[0], tables, lens, scale, 0, 0.0, nullptr, 0),
        counters_(new TaskCounter[k_caches.size()]),
        cos_(cos.data_ptr<float>()), sin_(sin.data_ptr<float>()), slots_(slots.data_ptr<int64_t>()) {
    const size_t L = k_caches.size();
    for (size_t i = 0; i < L; ++i) {
      std::optional<at::Tensor> ks, vs;
      if (!k_scales.empty()) ks = k_scales[i], vs = v_scales[i];
      layers_.push_back(call_.layer(k_caches[i], v_caches[i], ks, vs));
      Write w{k_caches[i].data_ptr<K>(), v_caches[i].data_ptr<K>()};
      if constexpr (kPerToken<K>) {
        w.k_rows = reinterpret_cast<c10::Half*>(ks->data_ptr()), w.v_rows = reinterpret_cast<c10::Half*>(vs->data_ptr());
      } else if constexpr (kQuantized<K>) {
        w.k_inv = 1.f / ks->data_ptr<float>()[0], w.v_inv = 1.f / vs->data_ptr<float>()[0];
      }
      writes_.push_back(w);
    }
  }
  void write(int64_t i, const float* qkv, float* q) override {
    const Write& w = writes_[i];
    rotary_write<float, float, K>(qkv, cos_, sin_, w.kc, w.vc, slots_, q, call_.B, call_.H, call_.KVH, call_.D, call_.NB,
                                  call_.BS, w.k_inv, w.v_inv, w.k_rows, w.v_rows);
  }
  void attend(int64_t i, const float* q, float* out) override { call_.run(layers_[i], q, out, counters_[i]); }
  bool split() const override { return call_.slots > 0; }
  void merge(int64_t, float* out, int64_t share, int64_t shares) override {
    const int64_t pairs = call_.B * call_.KVH, per = (pairs + shares - 1) / shares;
    call_.merge(out, std::min(pairs, share * per), std::min(pairs, (share + 1) * per));
  }

 private:
  struct Write {
    K* kc;
    K* vc;
    float k_inv = 1.f, v_inv = 1.f;
    c10::Half* k_rows = nullptr;
    c10::Half* v_rows = nullptr;
  };
  DecodeCall<float, K> call_;
  std::unique_ptr<TaskCounter[]> counters_;  // a layer's own: no reset between layers
  std::vector<typename DecodeCall<float, K>::Layer> layers_;
  std::vector<Write> writes_;
  const float* cos_;
  const float* sin_;
  const int64_t* slots_;
};

std::unique_ptr<StepAttention> step_attention(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                                              const at::Tensor& sin, const at::Tensor& slots,
                                              const at::Tensor& block_tables, const at::Tensor& context_lens,
                                              int64_t B, int64_t H, double scale, at::TensorList k_scales,
                                              at::TensorList v_scales) {
  const size_t L = k_caches.size();
  if (L == 0 || v_caches.size() != L) return nullptr;
  const at::Tensor& v0 = v_caches[0];
  if (v0.dim() != 4) return nullptr;
  const int64_t KVH = v0.size(0), NB = v0.size(1), BS = v0.size(2), D = v0.size(3);
  const at::ScalarType t = v0.scalar_type();
  const bool fp8 = t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
  if (!(t == at::kFloat || t == at::kBFloat16 || fp8 || t == at::kChar)) return nullptr;
  if (D > 512 || D % 2 != 0 || KVH <= 0 || H % KVH != 0) return nullptr;
  const std::vector<int64_t> ks{KVH, NB, D, BS}, vs{KVH, NB, BS, D};
  const bool scaled = fp8 || t == at::kChar;
  if (k_scales.size() != (scaled ? L : 0) || v_scales.size() != k_scales.size()) return nullptr;
  for (size_t i = 0; i < L; ++i) {
    const at::Tensor &k = k_caches[i], &v = v_caches[i];
    if (!k.is_contiguous() || !v.is_contiguous() || k.scalar_type() != t || v.scalar_type() != t ||
        k.sizes() != at::IntArrayRef(ks) || v.sizes() != at::IntArrayRef(vs))
      return nullptr;
    if (fp8) {
      for (const at::Tensor* sc : {&k_scales[i], &v_scales[i]})
        if (sc->scalar_type() != at::kFloat || sc->numel() != 1) return nullptr;
    } else if (scaled) {
      for (const at::Tensor* sc : {&k_scales[i], &v_scales[i]})
        if (sc->scalar_type() != at::kHalf || !sc->is_contiguous() || sc->numel() != KVH * NB * BS) return nullptr;
    }
  }
  if (!(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
        sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D))
    return nullptr;
  if (!(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B)) return nullptr;
  if (!(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
        block_tables.size(0) == B && context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
        context_lens.numel() == B))
    return nullptr;
  switch (t) {
    case at::kFloat:
      return std::make_unique<StepAttentionImpl<float>>(k_caches, v_caches, cos, sin, slots, block_tables, context_lens,
                                                        B, H, scale, k_scales, v_scales);
    case at::kBFloat16:
      return std::make_unique<StepAttentionImpl<c10::BFloat16>>(k_caches, v_caches, cos, sin, slots, block_tables,
                                                                context_lens, B, H, scale, k_scales, v_scales);
    case at::kFloat8_e4m3fn:
      return std::make_unique<StepAttentionImpl<c10::Float8_e4m3fn>>(k_caches, v_caches, cos, sin, slots, block_tables,
                                                                     context_lens, B, H, scale, k_scales, v_scales);
    case at::kFloat8_e5m2:
      return std::make_unique<StepAttentionImpl<c10::Float8_e5m2>>(k_caches, v_caches, cos, sin, slots, block_tables,
                                                                   context_lens, B, H, scale, k_scales, v_scales);
    default:
      return std::make_unique<StepAttentionImpl<int8_t>>(k_caches, v_caches, cos, sin, slots, block_tables,
                                                         context_lens, B, H, scale, k_scales, v_scales);
  }
}

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t hidden, float eps) {
  rms_norm_impl<float>(x, w, out, rows, hidden, eps);
}

void silu_and_mul_rows(const float* x, float* out, int64_t rows, int64_t inter) {
  silu_and_mul_impl<float>(x, out, rows, inter);
}

}  // namespace triollm_cpu

using namespace triollm_cpu;

TORCH_LIBRARY(triollm_cpu, m) {
  m.def("decode_attention_dot(bool quantized=False) -> str", [](bool quantized) {
    return std::string((quantized ? quant_dot_enabled() : bf16_dot_enabled()) ? "bf16" : "fp32");
  });
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, float softcap=0., Tensor? k_scale=None, "
        "Tensor? v_scale=None, Tensor? sinks=None, int chunk=0) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_starts, Tensor context_lens, float scale, Tensor? k_scale=None, "
        "Tensor? v_scale=None) -> Tensor");
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots, int num_heads, int num_kv_heads, Tensor(c!)? k_scale=None, "
        "Tensor(d!)? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(triollm_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
}
