// Weight-only quantized linear layers for CPU: y = x W^T with W kept quantized in 32-weight blocks.
//
// A weight is codes q (4 or 8 bits, unsigned) with an fp16 scale d and offset m per block of 32:
// weight = d * q + m (GGUF's Q4_1 as is; Q4_0: m = -8 d; Q8_0: q = w + 128, m = -128 d). A third
// code format, IQ4 (`kIq4`, GGUF's IQ4_NL and IQ4_XS), stores 4-bit indices into 16 non-linear
// levels and is read as the 8-bit codes level + 128 (m = -128 d): each vector path looks the
// nibbles up in a 16-byte table with a byte shuffle (`vpshufb`), so the weight stays 4.5 bits in
// memory and the arithmetic after the lookup is the 8-bit format's, to the bit. The
// activations are quantized per 32-value block to int8 with a float scale (llama.cpp's Q8
// activations): x ~= dx * qx, so each block's dot product is an integer one,
//   sum_j w_j x_j = dx * (d * sum_j q_j qx_j + m * sum_j qx_j),
// and AVX-512 VNNI `vpdpbusd` multiplies 64 unsigned code bytes by 64 signed activation bytes
// per instruction. The codes are laid out for it (`quant_linear_packed`, below): each weight
// byte is read once per call and every activation row of the batch uses it.
//
// Three paths over that one layout, each compiled for its own instruction set (a target pragma
// per path, whatever the build's -march), chosen at run time by what the CPU has (`resolve_isa`;
// $TRIOLLM_CPU_ISA forces one, for tests and A/B runs): AVX-512 VNNI; AVX2 (+FMA, F16C), which
// reads each 512-bit vector as two 256-bit halves of 8 rows and multiplies with `vpmaddubsw`
// (pairs of u8 x s8 products summed into int16 lanes) and `vpmaddwd` (pairs of those into int32,
// one row per lane), as ggml does; and plain loops. The integer block sums are exact on every
// path, and the float arithmetic after them is the same operations in the same order, so the
// three give the same bits (tests/kernels/test_quant.py), and a row's output is the same at every
// batch size (its offset term is summed apart on every path, as batch 1 does).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace triollm_cpu {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerPass = 8;  // activation rows whose accumulators live in registers

// The code formats (`bits`): 4 and 8, unsigned codes of that width; kIq4, 4-bit indices into
// IQ4's levels (ggml's kvalues_iq4nl), each standing for the 8-bit code level + 128 (kIq4Codes).
// A format's packed block is 256 bytes (4 and kIq4: nibbles) or 512 (8).
constexpr int kIq4 = -4;
alignas(16) constexpr uint8_t kIq4Codes[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// The same codes split in two nibble planes (code = 16 * high + low), for AVX2's u8 x s8 products
// in int16 lanes, which 8-bit codes would overflow (block_dot_avx2).
alignas(16) constexpr uint8_t kIq4Low[16] = {1, 8, 13, 15, 15, 13, 10, 6, 1, 13, 9, 6, 5, 5, 9, 1};
alignas(16) constexpr uint8_t kIq4High[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 13, 15};
constexpr int64_t block_bytes(int bits) { return bits == 8 ? 512 : 256; }

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// x [M, K] float -> qx int8 [M, K], dx float [M, K/32], sx float [M, K/32] (= dx * sum qx).
// `offset`: the codes are written as unsigned bytes qx + 128 instead (the AMX path's operand);
// `sq`, where given: each block's integer sum of codes.
// Rounding is to nearest even (nearbyint; the vector code's conversion under the default MXCSR),
// so both loops give the same codes.
void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx,
                          bool offset = false, int32_t* sq = nullptr) {
  const int64_t nb = K / kBlock;
  const uint8_t flip = offset ? 0x80 : 0;
  // Parallel from a prompt chunk's size up (a 200-row chunk of a 576-wide layer is 3,600 blocks,
  // ~0.1 ms alone); each block is its own, so the split does not change a bit.
  at::parallel_for(0, M * nb, M * nb < 512 ? M * nb : 128, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;  // row-major [M, K]: block i of the flat array
#ifdef __AVX512F__
      const __m512 x0 = _mm512_loadu_ps(src), x1 = _mm512_loadu_ps(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv)), v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
      const __m128i flip16 = _mm_set1_epi8(static_cast<char>(flip));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + i * kBlock), _mm_xor_si128(_mm512_cvtsepi32_epi8(v0), flip16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + i * kBlock + 16), _mm_xor_si128(_mm512_cvtsepi32_epi8(v1), flip16));
#else
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(src[j] * inv));
        qx[i * kBlock + j] = static_cast<int8_t>(static_cast<uint8_t>(v) ^ flip);
        sum += v;
      }
#endif
      dx[i] = d;
      sx[i] = d * static_cast<float>(sum);
      if (sq != nullptr) sq[i] = sum;
    }
  });
}

// ------------------------------------------------------------------------------------------
// The packed layout (QuantWeight.packed() in kernels/quant.py): output rows in groups of 16, so
// that one 512-bit register holds 16 rows x 4 codes and `vpdpbusd` against 4 activation bytes
// (broadcast) leaves each row's partial sum in its own lane: no horizontal sums, and a group's
// 16 outputs are stored together. Per group g and block b (32 codes of 16 rows):
//   4 bits: 256 bytes, 4 vectors t = 0..3 of [row 0 codes 4t..4t+3, row 1 ..., row 15 ...] in
//           the low nibbles and codes 4(t+4)..4(t+4)+3 in the high nibbles;
//   8 bits: 512 bytes, 8 vectors s = 0..7 of [row 0 codes 4s..4s+3, ..., row 15 ...];
//   dp, mp: fp16 [G, nb, 16], the 16 rows' scales and offsets of block b.
// Rows past N (the last group's padding) have zero codes and scales and are not stored.

// Every vector path reads block b of a group (`bytes` of codes at wb, then its scales and
// offsets) after prefetching 4 KB ahead (past a group's end: the next group's, contiguous): the
// weights stream from DRAM once per call, and the hardware prefetcher alone ramps up too slowly
// for these short streams (docs/benchmarks.md, quantized second pass). SSE's prefetch: no target.
inline void prefetch_block(const uint8_t* wb, int64_t bytes, const uint16_t* dg, const uint16_t* mg, int64_t b) {
  constexpr int64_t kAheadBytes = 4096;
  const int64_t ahead = kAheadBytes / bytes;
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + kAheadBytes + c), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(dg + (b + ahead) * 16), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(mg + (b + ahead) * 16), _MM_HINT_T0);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")
// Block b of a group: its 8 code vectors (4-bit codes split into low and high nibbles; IQ4's
// nibbles then looked up: 8-bit codes) and its 16 rows' scales and offsets (prefetching ahead:
// `prefetch_block`).
// A block's codes as 8 vectors of [output row 0 codes 4s..4s+3, row 1 ..., row 15 ...] (4-bit
// codes split into low and high nibbles, IQ4's then looked up: 8-bit codes).
template <int Bits>
inline void load_codes(const uint8_t* wb, __m512i w[8]) {
  if constexpr (Bits != 8) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(wb + t * 64));
      w[t] = _mm512_and_si512(v, low);
      w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (Bits == kIq4) {
      const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Codes)));
      for (int s = 0; s < 8; ++s) w[s] = _mm512_shuffle_epi8(table, w[s]);
    }
  } else {
    for (int s = 0; s < 8; ++s) w[s] = _mm512_loadu_si512(reinterpret_cast<const void*>(wb + s * 64));
  }
}

template <int Bits>
inline void load_block(const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t b, __m512i w[8], __m512& dw,
                       __m512& mw) {
  constexpr int64_t kBytes = block_bytes(Bits);
  const uint8_t* wb = qg + b * kBytes;
  prefetch_block(wb, kBytes, dg, mg, b);
  load_codes<Bits>(wb, w);
  dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
  mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * 16)));
}

template <int Bits>
inline void packed_group(const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t nb,
                         const int8_t* qx, const float* dx, const float* sx, int64_t K, int64_t rows,
                         float* out, int64_t ldo, __mmask16 store_mask) {
  __m512 acc[kRowsPerPass];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    __m512 dw, mw;
    load_block<Bits>(qg, dg, mg, b, w, dw, mw);
    (void)mw;  // the offsets: a pass of their own, below
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* xb = reinterpret_cast<const int32_t*>(qx + r * K + b * kBlock);
      __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xb[0]));
      __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(xb[1]));
      d0 = _mm512_dpbusd_epi32(d0, w[2], _mm512_set1_epi32(xb[2]));
      d1 = _mm512_dpbusd_epi32(d1, w[3], _mm512_set1_epi32(xb[3]));
      d0 = _mm512_dpbusd_epi32(d0, w[4], _mm512_set1_epi32(xb[4]));
      d1 = _mm512_dpbusd_epi32(d1, w[5], _mm512_set1_epi32(xb[5]));
      d0 = _mm512_dpbusd_epi32(d0, w[6], _mm512_set1_epi32(xb[6]));
      d1 = _mm512_dpbusd_epi32(d1, w[7], _mm512_set1_epi32(xb[7]));
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * (K / kBlock) + b])), acc[r]);
    }
  }
  // The offset term summed apart, block by block, and added last: exactly batch 1's arithmetic
  // (packed_group_m1), so a row's output does not depend on the rows beside it. Speculative
  // decoding's greedy output equals plain decoding's only because of that (engine/speculative/).
  __m512 acc_m[kRowsPerPass];
  for (int64_t r = 0; r < rows; ++r) acc_m[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * 16)));
    for (int64_t r = 0; r < rows; ++r) acc_m[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * (K / kBlock) + b]), acc_m[r]);
  }
  for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * ldo, store_mask, _mm512_add_ps(acc[r], acc_m[r]));
}

// Batch 1 (a decode token), the bandwidth-bound case: the same arithmetic with four independent
// dot-product chains and the offset term in an accumulator of its own (shorter dependency
// chains). Faster than packed_group<.., rows = 1> for the head and the layers, measured A/B
// interleaved in one process (docs/benchmarks.md, quantized second pass).
template <int Bits>
inline void packed_group_m1(const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t nb,
                            const int8_t* qx, const float* dx, const float* sx, float* out, __mmask16 store_mask) {
  __m512 acc = _mm512_setzero_ps(), acc_m = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    __m512 dw, mw;
    load_block<Bits>(qg, dg, mg, b, w, dw, mw);
    const int32_t* xb = reinterpret_cast<const int32_t*>(qx + b * kBlock);
    __m512i d[4];
    for (int c = 0; c < 4; ++c) d[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c], _mm512_set1_epi32(xb[c]));
    for (int c = 0; c < 4; ++c) d[c] = _mm512_dpbusd_epi32(d[c], w[c + 4], _mm512_set1_epi32(xb[c + 4]));
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(d[0], d[1]), _mm512_add_epi32(d[2], d[3])));
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(dx[b])), acc);
    acc_m = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[b]), acc_m);
  }
  _mm512_mask_storeu_ps(out, store_mask, _mm512_add_ps(acc, acc_m));
}
#pragma GCC pop_options

// ------------------------------------------------------------------------------------------
// AVX2: each 64-byte vector of the layout is two 256-bit halves, rows 0-7 and rows 8-15, and
// a half's 8 int32 lanes are its rows' dot products. `vpmaddubsw` sums two u8 x s8 products
// into an int16 lane, at most 2 * 15 * 127 = 3810 for 4-bit codes, so the 8 products of a block
// (32 codes) add up in int16 lanes without overflow (8 * 3810 = 30480 < 32767) before one
// `vpmaddwd` widens pairs of lanes to a row's int32 sum. 8-bit codes would overflow there, so
// they go through as two nibble planes, low + 16 * high, each as a 4-bit code would.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <int Bits>
inline __m256i block_dot_avx2(const uint8_t* wb, int half, const int32_t* xb) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  if constexpr (Bits == 4) {
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 64 + half * 32));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(v, low), _mm256_set1_epi32(xb[t])));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                     _mm256_set1_epi32(xb[t + 4])));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
  } else if constexpr (Bits == kIq4) {
    // The 8-bit sums below with each index looked up in the two nibble planes of its code: s0
    // and s1 take the same 8 products each, so the same bound holds.
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Low)));
    const __m256i hi = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4High)));
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 64 + half * 32));
      const __m256i i0 = _mm256_and_si256(v, low), i1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const __m256i x0 = _mm256_set1_epi32(xb[t]), x1 = _mm256_set1_epi32(xb[t + 4]);
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_shuffle_epi8(lo, i0), x0));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_shuffle_epi8(hi, i0), x0));
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_shuffle_epi8(lo, i1), x1));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_shuffle_epi8(hi, i1), x1));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, _mm256_set1_epi16(16)));
  } else {
    for (int t = 0; t < 8; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 64 + half * 32));
      const __m256i x = _mm256_set1_epi32(xb[t]);
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(v, low), x));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), x));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, _mm256_set1_epi16(16)));
  }
}

// A 4-bit block half's codes, split into its 8 nibble vectors once (the batched path reuses them
// for every activation row).
inline void load_codes4_avx2(const uint8_t* wb, int half, __m256i w[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + t * 64 + half * 32));
    w[t] = _mm256_and_si256(v, low);
    w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
}

// The same sums as block_dot_avx2<true> over codes already split.
inline __m256i codes4_dot_avx2(const __m256i w[8], const int32_t* xb) {
  __m256i s0 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xb[0]));
  __m256i s1 = _mm256_maddubs_epi16(w[4], _mm256_set1_epi32(xb[4]));
  for (int t = 1; t < 4; ++t) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(xb[t])));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[t + 4], _mm256_set1_epi32(xb[t + 4])));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
}

inline __m256 half8_avx2(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The first `valid` of a half's 8 lanes (valid in 0..8).
inline void store8_avx2(float* out, __m256 v, int64_t valid) {
  if (valid >= 8) {
    _mm256_storeu_ps(out, v);
  } else if (valid > 0) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane), v);
  }
}

template <int Bits>
void packed_group_m1_avx2(const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t nb, const int8_t* qx,
                          const float* dx, const float* sx, float* out, int64_t valid) {
  constexpr int64_t kBytes = block_bytes(Bits);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, acc_m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = qg + b * kBytes;
    prefetch_block(wb, kBytes, dg, mg, b);
    const int32_t* xb = reinterpret_cast<const int32_t*>(qx + b * kBlock);
    const __m256 scale = _mm256_set1_ps(dx[b]), offset = _mm256_set1_ps(sx[b]);
    for (int h = 0; h < 2; ++h) {
      const __m256 dot = _mm256_cvtepi32_ps(block_dot_avx2<Bits>(wb, h, xb));
      acc[h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(half8_avx2(dg + b * 16 + h * 8), scale), acc[h]);
      acc_m[h] = _mm256_fmadd_ps(half8_avx2(mg + b * 16 + h * 8), offset, acc_m[h]);
    }
  }
  for (int h = 0; h < 2; ++h) store8_avx2(out + h * 8, _mm256_add_ps(acc[h], acc_m[h]), valid - h * 8);
}

template <int Bits>
void packed_group_avx2(const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t nb, const int8_t* qx,
                       const float* dx, const float* sx, int64_t K, int64_t rows, float* out, int64_t ldo,
                       int64_t valid) {
  constexpr int64_t kBytes = block_bytes(Bits);
  for (int h = 0; h < 2 && h * 8 < valid; ++h) {
    __m256 acc[kRowsPerPass];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = qg + b * kBytes;
      if (h == 0) prefetch_block(wb, kBytes, dg, mg, b);
      const __m256 dw = half8_avx2(dg + b * 16 + h * 8);
      __m256i w[8];
      if constexpr (Bits == 4) load_codes4_avx2(wb, h, w);
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t* xb = reinterpret_cast<const int32_t*>(qx + r * K + b * kBlock);
        const __m256i idot = Bits == 4 ? codes4_dot_avx2(w, xb) : block_dot_avx2<Bits>(wb, h, xb);
        const __m256 dot = _mm256_cvtepi32_ps(idot);
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
      }
    }
    // The offset term apart and added last, as batch 1 does (see packed_group).
    __m256 acc_m[kRowsPerPass];
    for (int64_t r = 0; r < rows; ++r) acc_m[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 mw = half8_avx2(mg + b * 16 + h * 8);
      for (int64_t r = 0; r < rows; ++r) acc_m[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r * nb + b]), acc_m[r]);
    }
    for (int64_t r = 0; r < rows; ++r) store8_avx2(out + r * ldo + h * 8, _mm256_add_ps(acc[r], acc_m[r]), valid - h * 8);
  }
}
#pragma GCC pop_options


// ------------------------------------------------------------------------------------------
// AMX (Sapphire Rapids and later, `amx-tile` + `amx-int8`): the same integer block sums, 16
// activation rows x 16 output rows at a time, by one tile multiply per block. `tdpbusd` takes
// unsigned bytes on its left and signed ones on its right, so the roles swap against the VNNI
// path: the activation codes, offset by 128 to unsigned (qa = qx + 128, row-major, a tile's 16
// rows K bytes apart; `quantize_activations` writes them so), times the weight codes. One block's
// codes in the packed layout, nibbles split (the 8 vectors load_block makes), are exactly the
// right-hand tile: 8 rows of [output row 0 codes 4s..4s+3, row 1 ..., row 15 ...]. The offsets
// (128 on the left, and for 8-bit codes 128 on the right: `amx_unpack_group`) come off as exact
// integer terms, so a tile's row j is the VNNI path's integer dot vector of activation row j, bit
// for bit, and the float arithmetic after it is that path's, operation for operation: the outputs
// are the VNNI path's bits (tests/kernels/test_quant.py), and a row's bits do not depend on how
// many rows are beside it. A block is 32 codes, half a tile's depth, and its sums are scaled
// before the next block's are added, so each block's tile goes through memory to the vector
// units; the multiplies of the next two blocks are issued before two blocks' sums are finished.
// Used from `amx_min_rows` activation rows on (prompts, large decode batches).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c,amx-tile,amx-int8")

constexpr int64_t kAmxRows = 16;  // activation rows per tile
// Fewer activation rows than this take the VNNI code: below it the tiles' fixed costs (codes
// unpacked per call, a part-filled last tile, sums through memory) outweigh the faster multiply.
// 4-bit codes gain from 32 rows (0.62-0.90x the VNNI path's time); 8-bit and IQ4 codes, which
// cost more to unpack, only from 512 rows, or from 64 in a vocabulary head (>= 16,384 outputs:
// 0.84x at 64 rows, where the narrow layers ran 1.0-1.1x). Measured on a 2-core Xeon
// (docs/bench/quant_paths.py, docs/benchmarks.md "AMX Xeon").
constexpr int64_t amx_min_rows(int bits, int64_t n) { return bits == 4 ? 32 : (n >= 16384 ? 64 : 512); }

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0-3 = the int32 sums of a block [16 activation rows x 16 output rows], two pairs used in
// turn; 4, 5 = activation codes [16 rows x 32 bytes]; 6, 7 = a block's weight codes [8 rows x 64
// bytes].
inline void amx_configure() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = kAmxRows, cfg.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) cfg.rows[t] = kAmxRows, cfg.colsb[t] = kBlock;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = kBlock / 4, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Group g's codes as the tiles take them, block after block (nb x 512 bytes at wt), and per
// block and output row the integer term that comes off (nb x 16 at corr). 4-bit codes go as they
// are (signed bytes 0..15) and 128 x their sum comes off. 8-bit codes (and IQ4's looked up) do not
// fit a signed byte: they go as c - 128, and the sum (qx + 128)(c - 128) is sum qx c - 128 sum qx
// + 128 sum c - 32 x 128 x 128, so 128 sum c - 524288 comes off here and 128 sum qx is added back
// per activation row (`packed_group_amx`).
template <int Bits>
inline void amx_unpack_group(const uint8_t* qg, int64_t nb, uint8_t* wt, int32_t* corr) {
  constexpr int64_t kBytes = block_bytes(Bits);
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    load_codes<Bits>(qg + b * kBytes, w);
    __m512i sum = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
      sum = _mm512_dpbusd_epi32(sum, w[t], ones);
      _mm512_store_si512(reinterpret_cast<void*>(wt + b * 512 + t * 64), Bits == 4 ? w[t] : _mm512_xor_si512(w[t], flip));
    }
    const __m512i c = Bits == 4 ? sum : _mm512_sub_epi32(sum, _mm512_set1_epi32(4096));
    _mm512_store_si512(reinterpret_cast<void*>(corr + b * 16), _mm512_slli_epi32(c, 7));
  }
}

// kFull: all 16 rows (a constant trip count: the accumulators stay in registers).
// sq: the activation codes' integer sums per row and block (8-bit codes only, see above).
template <int Bits, bool kFull>
inline void packed_group_amx(const uint8_t* wt, const int32_t* corr, const uint16_t* dg, const uint16_t* mg,
                             int64_t nb, const uint8_t* qa, const float* dx, const float* sx, const int32_t* sq,
                             int64_t K, int64_t tail, float* out, int64_t ldo, __mmask16 store_mask) {
  const int64_t rows = kFull ? kAmxRows : tail;
  alignas(64) int32_t sums[2][2 * kAmxRows * 16];
  __m512 acc[kAmxRows];
  for (int64_t r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  // Block b's sums (at `at`) into the rows' accumulators, blocks in order (every path's order).
  auto finish = [&](int64_t b, const int32_t* at) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
    const __m512i c = _mm512_load_si512(reinterpret_cast<const void*>(corr + b * 16));
    for (int64_t r = 0; r < rows; ++r) {
      __m512i idot = _mm512_sub_epi32(_mm512_load_si512(reinterpret_cast<const void*>(at + r * 16)), c);
      if constexpr (Bits != 4) idot = _mm512_add_epi32(idot, _mm512_set1_epi32(128 * sq[r * nb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb + b])), acc[r]);
    }
  };
  // One or two blocks from b into tiles 0, 1 (`set` 0) or 2, 3 (`set` 1): issued, not waited for.
  auto multiply = [&](int64_t b, int64_t count, int64_t set) {
    _tile_loadd(4, qa + b * kBlock, K);
    _tile_loadd(6, wt + b * 512, 64);
    if (count > 1) {
      _tile_loadd(5, qa + (b + 1) * kBlock, K);
      _tile_loadd(7, wt + (b + 1) * 512, 64);
    }
    if (set == 0) {
      _tile_zero(0);
      _tile_dpbusd(0, 4, 6);
      if (count > 1) {
        _tile_zero(1);
        _tile_dpbusd(1, 5, 7);
      }
    } else {
      _tile_zero(2);
      _tile_dpbusd(2, 4, 6);
      if (count > 1) {
        _tile_zero(3);
        _tile_dpbusd(3, 5, 7);
      }
    }
  };
  auto store = [&](int32_t* at, int64_t count, int64_t set) {
    if (set == 0) {
      _tile_stored(0, at, 64);
      if (count > 1) _tile_stored(1, at + 256, 64);
    } else {
      _tile_stored(2, at, 64);
      if (count > 1) _tile_stored(3, at + 256, 64);
    }
  };
  // Software-pipelined over pairs of blocks, alternating between two pairs of result tiles and
  // two buffers: pair i is stored, pair i + 1's multiplies issued, then pair i - 1 (stored one
  // pair earlier) finished, so the tile unit and the vector units work at once and no load
  // waits on the store just made.
  const int64_t pairs = (nb + 1) / 2;
  auto count = [&](int64_t i) { return std::min<int64_t>(2, nb - 2 * i); };
  multiply(0, count(0), 0);
  for (int64_t i = 0; i < pairs; ++i) {
    store(sums[i & 1], count(i), i & 1);
    if (i + 1 < pairs) multiply(2 * (i + 1), count(i + 1), (i + 1) & 1);
    if (i > 0)
      for (int64_t j = 0; j < count(i - 1); ++j) finish(2 * (i - 1) + j, sums[(i - 1) & 1] + j * 256);
  }
  for (int64_t j = 0; j < count(pairs - 1); ++j) finish(2 * (pairs - 1) + j, sums[(pairs - 1) & 1] + j * 256);
  // The offset term apart, as every path sums it (packed_group).
  __m512 acc_m[kAmxRows];
  for (int64_t r = 0; r < rows; ++r) acc_m[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * 16)));
    for (int64_t r = 0; r < rows; ++r) acc_m[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb + b]), acc_m[r]);
  }
  for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * ldo, store_mask, _mm512_add_ps(acc[r], acc_m[r]));
}

// Groups [g0, g1) for all M rows, in tiles of groups whose unpacked codes stay in L2 (~256 KB):
// a tile's codes unpacked once, then 16 activation rows at a time (K bytes each: in L1) against
// every group of the tile.
template <int Bits>
void amx_groups(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t g0, int64_t g1, int64_t nb,
                const uint8_t* qa, const float* dx, const float* sx, const int32_t* sq, int64_t K, int64_t M, int64_t N,
                float* o) {
  amx_configure();
  const int64_t tile = std::max<int64_t>(1, (256 << 10) / (nb * 512));
  const int64_t span = std::min(tile, g1 - g0);
  std::unique_ptr<uint8_t[], void (*)(void*)> wt(static_cast<uint8_t*>(std::aligned_alloc(64, span * nb * 512)), std::free);
  std::unique_ptr<int32_t[], void (*)(void*)> corr(
      static_cast<int32_t*>(std::aligned_alloc(64, span * nb * 16 * sizeof(int32_t))), std::free);
  for (int64_t t0 = g0; t0 < g1; t0 += tile) {
    const int64_t t1 = std::min(g1, t0 + tile);
    for (int64_t g = t0; g < t1; ++g)
      amx_unpack_group<Bits>(q + g * nb * block_bytes(Bits), nb, wt.get() + (g - t0) * nb * 512, corr.get() + (g - t0) * nb * 16);
    for (int64_t r0 = 0; r0 < M; r0 += kAmxRows) {
      const int64_t rows = std::min(kAmxRows, M - r0);
      for (int64_t g = t0; g < t1; ++g) {
        const int64_t valid = std::min<int64_t>(16, N - g * 16);
        const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
        const uint8_t* wg = wt.get() + (g - t0) * nb * 512;
        const int32_t* cg = corr.get() + (g - t0) * nb * 16;
        const uint16_t* dg = d + g * nb * 16;
        const uint16_t* mg = m + g * nb * 16;
        float* og = o + r0 * N + g * 16;
        const int64_t at = r0 * nb;
        if (rows == kAmxRows) {
          packed_group_amx<Bits, true>(wg, cg, dg, mg, nb, qa + r0 * K, dx + at, sx + at, sq + at, K, rows, og, N, mask);
        } else {
          packed_group_amx<Bits, false>(wg, cg, dg, mg, nb, qa + r0 * K, dx + at, sx + at, sq + at, K, rows, og, N, mask);
        }
      }
    }
  }
  _tile_release();
}
#pragma GCC pop_options

// AMX needs the kernel's leave to use the tile registers (once per process: arch_prctl).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// ------------------------------------------------------------------------------------------
// AMX bf16 tiles for large inputs (`quant_linear_bf16`; the caller decides which take it:
// kernels/quant.py `TILE_MIN_ROWS`). The codes of one group of 16 outputs are dequantized once per
// call, block by block, into the right-hand tiles of `tdpbf16ps`, w = d * code + m (one fused
// multiply-add in fp32, rounded to bf16 to nearest even); the activations are rounded to bf16 the
// same way; the tiles accumulate in fp32 over the whole input, block after block, with no per-
// block scaling between them: the int8 path's cost (each block's sums scaled through memory) is
// what this path does not pay. So its numbers are not the int8 path's: a prompt token's are
// this path's wherever it runs, and a row's bits depend only on that row (each tile row is its
// own row's dot products, accumulated over the blocks in order; the padding rows are zeros whose
// sums are never stored), whatever the rows beside it, the row count or the thread count.
// One block of a group (32 codes x 16 outputs) is exactly one right-hand tile: 16 rows of code
// pairs (2k, 2k+1) x 16 outputs x 2 bf16.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,fma,f16c,amx-tile,amx-bf16")

// Tiles 0-3: sums [16 rows x 16 outputs] fp32 (row tile i, group j: 2i + j); 4, 5: two row
// tiles' activations [16 x 32 bf16]; 6, 7: two groups' block [16 code pairs x 16 outputs x 2].
inline void bf16_configure() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Group g's blocks as right-hand tiles, nb x 512 bf16 at wt. A code vector t (load_codes) holds
// per output lane the codes 4t..4t+3; its 16-byte chunk c is lanes 4c..4c+3, widened to 16
// floats [lane 4c codes 0-3, lane 4c+1 ...], scaled and offset by its lanes' d and m (each
// repeated 4 times); tile row 2t takes each lane's codes 4t, 4t+1 (`even`), row 2t+1 its 4t+2,
// 4t+3 (`odd`), lanes 0-7 from chunks 0, 1 and lanes 8-15 from chunks 2, 3.
template <int Bits>
inline void bf16_unpack_group(const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t nb, uint16_t* wt) {
  alignas(64) static constexpr int32_t kEven[16] = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const __m512i even = _mm512_load_si512(reinterpret_cast<const void*>(kEven));
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(2));
  constexpr int64_t kBytes = block_bytes(Bits);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    load_codes<Bits>(qg + b * kBytes, w);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * 16)));
    __m512 dc[4], mc[4];
    for (int c = 0; c < 4; ++c) {
      // lane 4c + i/4 for element i: the index vector (i >> 2) + 4c
      const __m512i idx = _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2),
                                           _mm512_set1_epi32(4 * c));
      dc[c] = _mm512_permutexvar_ps(idx, dw);
      mc[c] = _mm512_permutexvar_ps(idx, mw);
    }
    uint16_t* tile = wt + b * 512;
    for (int t = 0; t < 8; ++t) {
      __m512 f[4];
      for (int c = 0; c < 4; ++c) {
        const __m512i codes = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(w[t], c));
        f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), dc[c], mc[c]);
      }
      const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(f[2], even, f[3]), _mm512_permutex2var_ps(f[0], even, f[1]));
      const __m512bh hi = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(f[2], odd, f[3]), _mm512_permutex2var_ps(f[0], odd, f[1]));
      _mm512_store_si512(reinterpret_cast<void*>(tile + (2 * t) * 32), reinterpret_cast<const __m512i&>(lo));
      _mm512_store_si512(reinterpret_cast<void*>(tile + (2 * t + 1) * 32), reinterpret_cast<const __m512i&>(hi));
    }
  }
}

// A 64-byte-aligned buffer of at least `bytes`, the calling thread's, kept across calls (grown,
// never shrunk): a prompt chunk's activations are megabytes, and a fresh allocation of that size
// is a fresh mapping whose pages the kernel faults in and zeroes on every call (10% of a prefill's
// profile). Valid until the thread's next call.
inline void* thread_scratch(size_t bytes) {
  thread_local std::unique_ptr<uint8_t[], void (*)(void*)> buf(nullptr, std::free);
  thread_local size_t size = 0;
  if (bytes > size) {
    size = (bytes + 4095) / 4096 * 4096;
    buf.reset(static_cast<uint8_t*>(std::aligned_alloc(64, size)));
  }
  return buf.get();
}

// x [M, K] fp32 -> bf16 rows (round to nearest even), K apart; rows [M, padded) zeroed.
void bf16_rows(const float* x, int64_t M, int64_t padded, int64_t K, uint16_t* xa) {
  at::parallel_for(0, padded, M * K < (1 << 16) ? padded : 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* dst = xa + r * K;
      if (r >= M) {
        std::memset(dst, 0, K * sizeof(uint16_t));
        continue;
      }
      const float* src = x + r * K;
      for (int64_t k = 0; k < K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
        _mm512_storeu_si512(reinterpret_cast<void*>(dst + k), reinterpret_cast<const __m512i&>(v));
      }
    }
  });
}

// Groups [g0, g1) for all rows, in tiles of groups whose dequantized blocks stay in L2 (~512 KB):
// a tile's blocks dequantized once, then 32 rows at a time (their bf16 activations: in L1) against
// every pair of groups of the tile, the blocks in order into four sum tiles; each row's outputs
// of a tile are written together. `Swiglu` (a fused gate/up projection, gate groups [0, half) and
// up groups [half, 2 half)): [g0, g1) are gate groups, each paired with its up group g + half,
// and the pair's sums leave as silu(gate) * up, computed as `silu_and_mul` does (exp's argument
// capped at 88 as there), into o [M, N / 2].
constexpr int64_t kPanelBlocks = 24;  // `bf16_groups`: a 32-row panel of 24 blocks is L1's 48 KB
constexpr int64_t kChunkBlocks = 8;   // ... and a longer input goes 8 blocks (256 inputs) at a time

template <int Bits, bool Swiglu>
void bf16_groups(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t g0, int64_t g1, int64_t nb,
                 const uint16_t* xa, int64_t K, int64_t M, int64_t padded, int64_t N, float* o, int64_t half = 0) {
  bf16_configure();
  // Dequantized groups per tile (even); with Swiglu each step of g takes two groups.
  const int64_t tile = std::max<int64_t>(2, (512 << 10) / (nb * 1024) / 2 * 2) / (Swiglu ? 2 : 1);
  const int64_t span = std::min(tile, g1 - g0) * (Swiglu ? 2 : 1);
  std::unique_ptr<uint16_t[], void (*)(void*)> wt(
      static_cast<uint16_t*>(std::aligned_alloc(64, span * nb * 512 * sizeof(uint16_t))), std::free);
  // A 32-row panel of inputs stays in L1 while the groups' blocks stream past it (tile loads with
  // the non-temporal hint) where it fits there (`kPanelBlocks`); a longer input goes in chunks of
  // `kChunkBlocks`, each group pair's sums waiting in `acc` between chunks (4 tiles a pair) and
  // loaded back: the same fp32 sums in the same order, so the same bits as one pass. Chunking an
  // input that fits costs more than it saves (the sums' round trips): 18 blocks, whole, 0.81-0.86x
  // the time of 8-block chunks (docs/bench/tile_linear.py).
  const int64_t step = Swiglu ? 1 : 2, ldo = Swiglu ? half * 16 : N;
  const int64_t chunk = nb > kPanelBlocks ? kChunkBlocks : nb;
  alignas(64) float own[4][256];
  std::unique_ptr<float[][256], void (*)(void*)> acc(
      chunk < nb ? static_cast<float(*)[256]>(std::aligned_alloc(64, (tile / step + 1) * 4 * 256 * sizeof(float))) : nullptr,
      std::free);
  const int64_t group_bytes = nb * block_bytes(Bits);
  for (int64_t t0 = g0; t0 < g1; t0 += tile) {
    const int64_t t1 = std::min(g1, t0 + tile);
    for (int64_t g = t0; g < t1; ++g) {
      if (Swiglu) {
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t src = g + h * half;
          bf16_unpack_group<Bits>(q + src * group_bytes, d + src * nb * 16, m + src * nb * 16, nb,
                                  wt.get() + (2 * (g - t0) + h) * nb * 512);
        }
      } else {
        bf16_unpack_group<Bits>(q + g * group_bytes, d + g * nb * 16, m + g * nb * 16, nb, wt.get() + (g - t0) * nb * 512);
      }
    }
    for (int64_t r0 = 0; r0 < padded; r0 += 32) {
      const bool two_rows = r0 + 16 < padded;
      const uint16_t* a0 = xa + r0 * K;
      const uint16_t* a1 = a0 + 16 * K;
      for (int64_t c0 = 0; c0 < nb; c0 += chunk) {
      const int64_t c1 = std::min(nb, c0 + chunk);
      for (int64_t g = t0; g < t1; g += step) {
        const int64_t groups = Swiglu ? 2 : std::min<int64_t>(2, t1 - g);
        const uint16_t* w0 = wt.get() + (Swiglu ? 2 : 1) * (g - t0) * nb * 512;
        const uint16_t* w1 = w0 + nb * 512;
        float(*sums)[256] = chunk < nb ? acc.get() + (g - t0) / step * 4 : own;
        if (c0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, sums[0], 64);
          _tile_loadd(1, sums[1], 64);
          _tile_loadd(2, sums[2], 64);
          _tile_loadd(3, sums[3], 64);
        }
        for (int64_t b = c0; b < c1; ++b) {
          _tile_loadd(4, a0 + b * kBlock, K * 2);
          _tile_stream_loadd(6, w0 + b * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (groups > 1) {
            _tile_stream_loadd(7, w1 + b * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_rows) {
            _tile_loadd(5, a1 + b * kBlock, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (groups > 1) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        if (c1 < nb) continue;  // the next chunk adds to these sums
        for (int64_t i = 0; i < (two_rows ? 2 : 1); ++i) {
          if (Swiglu) {
            for (int64_t r = 0; r < 16 && r0 + 16 * i + r < M; ++r) {
              const float* gs = sums[2 * i] + r * 16;
              const float* us = sums[2 * i + 1] + r * 16;
              float* dst = o + (r0 + 16 * i + r) * ldo + g * 16;
#pragma omp simd
              for (int64_t c = 0; c < 16; ++c) dst[c] = gs[c] / (1.f + std::exp(std::min(-gs[c], 88.f))) * us[c];
            }
            continue;
          }
          for (int64_t j = 0; j < groups; ++j) {
            const int64_t valid = std::min<int64_t>(16, N - (g + j) * 16);
            const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
            const float* sv = sums[2 * i + j];
            for (int64_t r = 0; r < 16 && r0 + 16 * i + r < M; ++r)
              _mm512_mask_storeu_ps(o + (r0 + 16 * i + r) * ldo + (g + j) * 16, mask, _mm512_load_ps(sv + r * 16));
          }
        }
      }
      }
    }
  }
  _tile_release();
}
#pragma GCC pop_options

bool bf16_tiles_run() {
  __builtin_cpu_init();
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
                         __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted();
  return ok;
}

// A packed weight of N outputs over K inputs in `bits` codes (4, 8 or kIq4: IQ4 indices), or an
// error naming `op` and what does not match.
void check_packed_weight(const char* op, int64_t K, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                         int64_t bits, int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 8 || bits == kIq4, op, ": bits must be 4, 8 or ", kIq4, " (IQ4 indices), got ", bits);
  const int64_t nb = K / kBlock, G = qp.size(0);
  TORCH_CHECK(K % kBlock == 0 && qp.dim() == 3 && qp.size(1) == nb && qp.size(2) == block_bytes(static_cast<int>(bits)) &&
                  qp.scalar_type() == at::kByte && dp.sizes() == at::IntArrayRef({G, nb, 16}) &&
                  mp.sizes() == dp.sizes() && dp.scalar_type() == at::kHalf && mp.scalar_type() == at::kHalf &&
                  N <= G * 16 && N > (G - 1) * 16,
              op, ": the packed weight does not match ", K, " inputs and N=", N);
}

// Both quantized linears' arguments: x [M, K] fp32 and a packed weight for K inputs.
void check_packed(const char* op, const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                  int64_t bits, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be [M, K] float32");
  check_packed_weight(op, x.size(1), qp, dp, mp, bits, N);
}

// `x @ W.T` over the packed weight by bf16 tiles (above); only where `bf16_tiles_run()`. `swiglu`:
// W is a fused gate/up projection of N = 2 I outputs (I a multiple of 16), and the result is
// silu(x @ Wg.T) * (x @ Wu.T), [M, I], with the sums never leaving the kernel.
at::Tensor bf16_linear(const char* op, const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp,
                       const at::Tensor& mp, int64_t bits, int64_t N, bool swiglu) {
  check_packed(op, x, qp, dp, mp, bits, N);
  TORCH_CHECK(bf16_tiles_run(), op, ": needs AMX bf16 tiles (amx-tile, amx-bf16, avx512-bf16)");
  TORCH_CHECK(!swiglu || N % 32 == 0, op, ": a gate/up projection of N=", N, " outputs: N must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, G = qp.size(0), half = G / 2;
  const int fmt = static_cast<int>(bits);
  at::Tensor out = at::empty({M, swiglu ? N / 2 : N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xc = x.contiguous(), qc = qp.contiguous(), dc = dp.contiguous(), mc = mp.contiguous();
  const int64_t padded = (M + 15) / 16 * 16;
  uint16_t* const xa = static_cast<uint16_t*>(thread_scratch(padded * K * sizeof(uint16_t)));
  bf16_rows(xc.data_ptr<float>(), M, padded, K, xa);
  const auto* q = qc.data_ptr<uint8_t>();
  const auto* d = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const auto* m = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  if (swiglu) {  // tasks of gate groups, each with its up group
    at::parallel_for(0, half, 1, [&](int64_t g0, int64_t g1) {
      if (fmt == 4) bf16_groups<4, true>(q, d, m, g0, g1, nb, xa, K, M, padded, N, o, half);
      else if (fmt == 8) bf16_groups<8, true>(q, d, m, g0, g1, nb, xa, K, M, padded, N, o, half);
      else bf16_groups<kIq4, true>(q, d, m, g0, g1, nb, xa, K, M, padded, N, o, half);
    });
    return out;
  }
  // Tasks of whole group pairs (a pair's codes are dequantized together).
  at::parallel_for(0, (G + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    const int64_t g0 = 2 * p0, g1 = std::min(G, 2 * p1);
    if (fmt == 4) bf16_groups<4, false>(q, d, m, g0, g1, nb, xa, K, M, padded, N, o);
    else if (fmt == 8) bf16_groups<8, false>(q, d, m, g0, g1, nb, xa, K, M, padded, N, o);
    else bf16_groups<kIq4, false>(q, d, m, g0, g1, nb, xa, K, M, padded, N, o);
  });
  return out;
}

at::Tensor quant_linear_bf16(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                             int64_t bits, int64_t N) {
  return bf16_linear("quant_linear_bf16", x, qp, dp, mp, bits, N, false);
}

at::Tensor quant_swiglu_bf16(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                             int64_t bits, int64_t N) {
  return bf16_linear("quant_swiglu_bf16", x, qp, dp, mp, bits, N, true);
}

// The plain loops' view of the packed layout: the code of row `lane`, input `k` of group g.
inline int32_t packed_code(const uint8_t* qg, int bits, int64_t lane, int64_t k) {
  const int64_t b = k / kBlock, c = k % kBlock, s = c / 4, j = c % 4;
  if (bits == 8) return qg[b * 512 + s * 64 + lane * 4 + j];
  const uint8_t byte = qg[b * 256 + (s % 4) * 64 + lane * 4 + j];
  const uint8_t nibble = s < 4 ? (byte & 0x0F) : (byte >> 4);
  return bits == kIq4 ? kIq4Codes[nibble] : nibble;
}

// The plain loops: the same integer sums, and per output lane the same float operations in the
// same order as the vector paths (fused multiply-adds, the offset sum kept apart), so all paths
// give the same bits, and a row the same bits at every batch size.
void packed_group_scalar(const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t nb, const int8_t* qx,
                         const float* dx, const float* sx, int64_t K, int64_t M, int bits, int64_t valid,
                         float* out, int64_t ldo) {
  for (int64_t lane = 0; lane < valid; ++lane) {
    for (int64_t r = 0; r < M; ++r) {
      float acc = 0.f, acc_m = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t c = 0; c < kBlock; ++c) dot += packed_code(qg, bits, lane, b * kBlock + c) * qx[r * K + b * kBlock + c];
        const float d = half_to_float(dg[b * 16 + lane]), m = half_to_float(mg[b * 16 + lane]);
        acc = std::fma(static_cast<float>(dot), d * dx[r * nb + b], acc);
        acc_m = std::fma(m, sx[r * nb + b], acc_m);
      }
      out[r * ldo + lane] = acc + acc_m;
    }
  }
}

// The quantized kernel's paths, best first.
enum class QuantIsa { kAmx, kAvx512Vnni, kAvx2, kScalar };

const char* isa_name(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kAmx:
      return "amx";
    case QuantIsa::kAvx512Vnni:
      return "avx512_vnni";
    case QuantIsa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

bool cpu_runs(QuantIsa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case QuantIsa::kAmx:
      return cpu_runs(QuantIsa::kAvx512Vnni) && __builtin_cpu_supports("amx-tile") &&
             __builtin_cpu_supports("amx-int8") && amx_permitted();
    case QuantIsa::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case QuantIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default:
      return true;
  }
}

std::string runnable_isas() {
  std::string names;
  for (QuantIsa isa : {QuantIsa::kAmx, QuantIsa::kAvx512Vnni, QuantIsa::kAvx2, QuantIsa::kScalar})
    if (cpu_runs(isa)) names += (names.empty() ? "" : ", ") + std::string(isa_name(isa));
  return names;
}

// "auto": $TRIOLLM_CPU_ISA if set, else the best path this CPU runs (resolved once per process).
// A named path the CPU cannot run is an error, never an illegal instruction.
QuantIsa resolve_isa(const std::string& name) {
  auto parse = [](const std::string& n) {
    for (QuantIsa isa : {QuantIsa::kAmx, QuantIsa::kAvx512Vnni, QuantIsa::kAvx2, QuantIsa::kScalar}) {
      if (n == isa_name(isa)) {
        TORCH_CHECK(cpu_runs(isa), "quantized kernel path '", n, "' needs CPU features this CPU lacks; allowed here: ",
                    runnable_isas());
        return isa;
      }
    }
    TORCH_CHECK(false, "quantized kernel path '", n, "' is unknown; allowed: auto, amx, avx512_vnni, avx2, scalar");
    return QuantIsa::kScalar;
  };
  if (name != "auto") return parse(name);
  static const QuantIsa chosen = [&] {
    const char* forced = std::getenv("TRIOLLM_CPU_ISA");
    if (forced != nullptr && *forced != '\0') {
      std::string lower(forced);
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return parse(lower);
    }
    for (QuantIsa isa : {QuantIsa::kAmx, QuantIsa::kAvx512Vnni, QuantIsa::kAvx2})
      if (cpu_runs(isa)) return isa;
    return QuantIsa::kScalar;
  }();
  return chosen;
}

// Group g's 16 outputs (`valid` of them real) for all M rows, by one vector path.
template <int Bits>
void vector_group(QuantIsa isa, const uint8_t* qg, const uint16_t* dg, const uint16_t* mg, int64_t nb,
                  const int8_t* qx, const float* dx, const float* sx, int64_t K, int64_t M, int64_t valid, float* out,
                  int64_t N) {
  if (isa == QuantIsa::kAvx2) {
    if (M == 1) return packed_group_m1_avx2<Bits>(qg, dg, mg, nb, qx, dx, sx, out, valid);
    for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, M - r0);
      packed_group_avx2<Bits>(qg, dg, mg, nb, qx + r0 * K, dx + r0 * nb, sx + r0 * nb, K, rows, out + r0 * N, N, valid);
    }
    return;
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  if (M == 1) return packed_group_m1<Bits>(qg, dg, mg, nb, qx, dx, sx, out, mask);
  for (int64_t r0 = 0; r0 < M; r0 += kRowsPerPass) {
    const int64_t rows = std::min(kRowsPerPass, M - r0);
    packed_group<Bits>(qg, dg, mg, nb, qx + r0 * K, dx + r0 * nb, sx + r0 * nb, K, rows, out + r0 * N, N, mask);
  }
}

// Groups [g0, g1) of the output (16 rows each; out [M, N]) for M rows of quantized activations,
// by the non-AMX path `isa` names: each group is its own, so any split gives the same bits.
void packed_groups(QuantIsa isa, const uint8_t* q, const uint16_t* d, const uint16_t* m, int fmt, int64_t N, int64_t K,
                   int64_t M, const int8_t* qx, const float* dx, const float* sx, int64_t g0, int64_t g1, float* o) {
  const int64_t nb = K / kBlock, group_bytes = nb * block_bytes(fmt);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t valid = std::min<int64_t>(16, N - g * 16);
    const uint8_t* qg = q + g * group_bytes;
    const uint16_t* dg = d + g * nb * 16;
    const uint16_t* mg = m + g * nb * 16;
    if (isa == QuantIsa::kScalar) {
      packed_group_scalar(qg, dg, mg, nb, qx, dx, sx, K, M, fmt, valid, o + g * 16, N);
    } else if (fmt == 4) {
      vector_group<4>(isa, qg, dg, mg, nb, qx, dx, sx, K, M, valid, o + g * 16, N);
    } else if (fmt == 8) {
      vector_group<8>(isa, qg, dg, mg, nb, qx, dx, sx, K, M, valid, o + g * 16, N);
    } else {
      vector_group<kIq4>(isa, qg, dg, mg, nb, qx, dx, sx, K, M, valid, o + g * 16, N);
    }
  }
}

// `isa`: "auto" (module note), or a path by name (tests compare them). `bits`: 4, 8 or kIq4.
at::Tensor quant_linear_packed(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp,
                               const at::Tensor& mp, int64_t bits, int64_t N, const std::string& isa_name_arg) {
  check_packed("quant_linear_packed", x, qp, dp, mp, bits, N);
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, G = qp.size(0);
  const int fmt = static_cast<int>(bits);
  const QuantIsa isa = resolve_isa(isa_name_arg);
  const at::Tensor xc = x.contiguous(), qc = qp.contiguous(), dc = dp.contiguous(), mc = mp.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const bool amx = isa == QuantIsa::kAmx && M >= amx_min_rows(fmt, N);
  // Written whole by quantize_activations before any read: not zeroed first (a prompt chunk's
  // memset showed in the profile). The AMX path reads whole tiles of 16 rows: its buffer is
  // padded to them, and only the padding is set (those rows' sums are never stored).
  const int64_t rows = amx ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M;
  const std::unique_ptr<int8_t[]> qx_buf(new int8_t[rows * K]);
  std::memset(qx_buf.get() + M * K, 0, (rows - M) * K);
  const std::unique_ptr<float[]> dx_buf(new float[M * nb]), sx_buf(new float[M * nb]);
  int8_t* const qx = qx_buf.get();
  float* const dx = dx_buf.get();
  float* const sx = sx_buf.get();
  // The codes' integer sums: only the AMX path's 8-bit and IQ4 codes need them.
  const std::unique_ptr<int32_t[]> sq(amx && fmt != 4 ? new int32_t[M * nb] : nullptr);
  quantize_activations(xc.data_ptr<float>(), M, K, qx, dx, sx, amx, sq.get());
  const auto* q = qc.data_ptr<uint8_t>();
  const auto* d = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const auto* m = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  const int64_t group_bytes = nb * block_bytes(fmt);
  // Tasks of at least ~32K weight bytes x activation rows: smaller ones cost more to start.
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (group_bytes * M));
  if (amx) {
    const auto* qa = reinterpret_cast<const uint8_t*>(qx);
    at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
      if (fmt == 4) amx_groups<4>(q, d, m, g0, g1, nb, qa, dx, sx, sq.get(), K, M, N, o);
      else if (fmt == 8) amx_groups<8>(q, d, m, g0, g1, nb, qa, dx, sx, sq.get(), K, M, N, o);
      else amx_groups<kIq4>(q, d, m, g0, g1, nb, qa, dx, sx, sq.get(), K, M, N, o);
    });
    return out;
  }
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) { packed_groups(isa, q, d, m, fmt, N, K, M, qx, dx, sx, g0, g1, o); });
  return out;
}

bool packed_vector_path(int64_t M, int64_t bits, int64_t N) {
  return !(resolve_isa("auto") == QuantIsa::kAmx && M >= amx_min_rows(static_cast<int>(bits), N));
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
  quantize_activations(x, M, K, qx, dx, sx);
}

void packed_groups_auto(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t bits, int64_t N, int64_t K,
                        int64_t M, const int8_t* qx, const float* dx, const float* sx, int64_t g0, int64_t g1,
                        float* out) {
  packed_groups(resolve_isa("auto"), q, d, m, static_cast<int>(bits), N, K, M, qx, dx, sx, g0, g1, out);
}

// Rows `index` of a packed weight, dense fp32 [R, K]: an embedding lookup of a quantized tied
// embedding, as PackedWeight.dequantize_rows computes it in torch (code * d, rounded, + m: the
// product is kept out of an FMA), in one call instead of a dozen ops.
at::Tensor packed_rows(const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp, int64_t bits,
                       const at::Tensor& index) {
  TORCH_CHECK(qp.dim() == 3 && (bits == 4 || bits == 8 || bits == kIq4) && qp.size(2) == block_bytes(static_cast<int>(bits)) &&
                  qp.scalar_type() == at::kByte && dp.sizes() == at::IntArrayRef({qp.size(0), qp.size(1), 16}) &&
                  mp.sizes() == dp.sizes() && dp.scalar_type() == at::kHalf && mp.scalar_type() == at::kHalf,
              "packed_rows: a packed weight (bits 4, 8 or IQ4)");
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "packed_rows: index int64 [R]");
  const int64_t G = qp.size(0), nb = qp.size(1), K = nb * kBlock, R = index.size(0);
  const at::Tensor ic = index.contiguous(), qc = qp.contiguous(), dc = dp.contiguous(), mc = mp.contiguous();
  const int64_t* ix = ic.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ix[r] >= 0 && ix[r] < G * 16, "packed_rows: index ", ix[r], " out of range [0, ", G * 16, ")");
  at::Tensor out = at::empty({R, K}, qp.options().dtype(at::kFloat));
  const int fmt = static_cast<int>(bits);
  const int64_t bb = block_bytes(fmt);
  const uint8_t* q = qc.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(dc.data_ptr<at::Half>());
  const uint16_t* m = reinterpret_cast<const uint16_t*>(mc.data_ptr<at::Half>());
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = ix[r] / 16, lane = ix[r] % 16;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = q + (g * nb + b) * bb;
      const float db = half_to_float(d[(g * nb + b) * 16 + lane]), mb = half_to_float(m[(g * nb + b) * 16 + lane]);
      float* dst = o + r * K + b * kBlock;
      for (int c = 0; c < kBlock; ++c) {
        int code;
        if (fmt == 8) {
          code = blk[(c / 4) * 64 + lane * 4 + c % 4];  // vector s = c / 4
        } else {
          const int t = (c / 4) % 4, j = c % 4;  // codes 16.. in the high nibbles
          const uint8_t byte = blk[t * 64 + lane * 4 + j];
          code = c < 16 ? (byte & 0x0F) : (byte >> 4);
          if (fmt == kIq4) code = kIq4Codes[code];
        }
        float prod = static_cast<float>(code) * db;
        asm("" : "+x"(prod));  // rounded here, as torch's separate multiply: no FMA with the add
        dst[c] = prod + mb;
      }
    }
  }
  return out;
}

// The path "auto" takes in this process (kernels/cpu_native.py `quant_isa` agrees).
std::string quant_isa_op() { return isa_name(resolve_isa("auto")); }

// The int8 activations, their scales and scale * sum (for tests: the kernel's exact inputs).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations_op(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kBlock == 0,
              "quantize_activations: x must be [M, K] float32 with K a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  at::Tensor qx = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, nb}, x.options());
  at::Tensor sx = at::empty({M, nb}, x.options());
  quantize_activations(xc.data_ptr<float>(), M, K, qx.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  return {qx, dx, sx};
}

}  // namespace triollm_cpu

using namespace triollm_cpu;

TORCH_LIBRARY_FRAGMENT(triollm_cpu, m) {
  m.def("quant_linear_packed(Tensor x, Tensor qp, Tensor dp, Tensor mp, int bits, int n, str isa=\"auto\") -> Tensor");
  m.def("quant_isa() -> str", &quant_isa_op);
  m.def("packed_rows(Tensor qp, Tensor dp, Tensor mp, int bits, Tensor index) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_linear_bf16(Tensor x, Tensor qp, Tensor dp, Tensor mp, int bits, int n) -> Tensor");
  m.def("quant_swiglu_bf16(Tensor x, Tensor qp, Tensor dp, Tensor mp, int bits, int n) -> Tensor");
  m.def("bf16_tiles() -> bool", &bf16_tiles_run);
}

TORCH_LIBRARY_IMPL(triollm_cpu, CPU, m) {
  m.impl("quant_linear_packed", &quant_linear_packed);
  m.impl("quantize_activations", &quantize_activations_op);
  m.impl("packed_rows", &packed_rows);
  m.impl("quant_linear_bf16", &quant_linear_bf16);
  m.impl("quant_swiglu_bf16", &quant_swiglu_bf16);
}
