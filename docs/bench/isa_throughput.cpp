// How many of the decode attention's instructions this CPU retires: independent `vdpbf16ps`,
// `vfmadd` (AVX-512) and `vpermt2b` chains, 100M rounds each, ns per instruction. The fp8/int8
// decode kernels (kernels/csrc/cpu_attention.cpp) spend about one `vdpbf16ps` per 16 values of
// K or V for each query head, and their code lookups several shuffles per 64 codes, so these
// three figures bound a block's time where the cache is not the limit (docs/benchmarks-history.md,
// "Where an 8k decode step and a prompt step go on the AMX Xeon"). Needs AVX-512 BF16 and VBMI.
//
//     g++ -O2 -march=native docs/bench/isa_throughput.cpp -o /tmp/isa && /tmp/isa
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  constexpr long kRounds = 100000000;
  auto ns_per = [](auto t0, auto t1, double n) {
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
  };
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512i a = _mm512_set1_epi32(0x3f803f80), b = a;
  auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kRounds; ++n) {
    for (auto& c : acc) c = _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
    __asm__ volatile("" : "+v"(a));
  }
  auto t1 = std::chrono::steady_clock::now();
  float s = 0;
  for (auto& c : acc) s += _mm512_reduce_add_ps(c);
  std::printf("vdpbf16ps zmm: %.3f ns per instruction (%g)\n", ns_per(t0, t1, kRounds * 12.0), s);

  __m512 f[12];
  for (auto& v : f) v = _mm512_setzero_ps();
  __m512 x = _mm512_set1_ps(1.0001f);
  t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kRounds; ++n) {
    for (auto& v : f) v = _mm512_fmadd_ps(v, x, x);
    __asm__ volatile("" : "+v"(x));
  }
  t1 = std::chrono::steady_clock::now();
  s = 0;
  for (auto& v : f) s += _mm512_reduce_add_ps(v);
  std::printf("vfmadd231ps zmm: %.3f ns per instruction (%g)\n", ns_per(t0, t1, kRounds * 12.0), s);

  __m512i t[8];
  for (int i = 0; i < 8; ++i) t[i] = _mm512_set1_epi8(static_cast<char>(i));
  __m512i idx = _mm512_set1_epi8(3), tb = _mm512_set1_epi8(7);
  t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kRounds; ++n) {
    for (auto& v : t) v = _mm512_permutex2var_epi8(v, idx, tb);
    __asm__ volatile("" : "+v"(idx));
  }
  t1 = std::chrono::steady_clock::now();
  long r = 0;
  for (auto& v : t) r += _mm512_reduce_add_epi32(v);
  std::printf("vpermt2b zmm: %.3f ns per instruction (%ld)\n", ns_per(t0, t1, kRounds * 8.0), r);
}
