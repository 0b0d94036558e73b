// CPU backend of ckptq::requantize and ckptq::amax (registered under the CPU dispatch key).
//
// One design for every source -> target pair: the target's blocks define tiles; per tile each row
// segment is decoded from the source format into a bounded per-thread fp32 scratch row (at most
// one tile row, <= 512 floats, in L1: no tensor-sized intermediate is ever written), block amaxes
// are reduced, the block scales computed, and the row encoded into the target format. Targets
// whose blocks span several rows (fp8_block 128x128, nvfp4 16x16, the mxfp8 32x1 columnwise
// copy) decode the tile's rows twice (amax pass, encode pass) while the source tile is still in
// cache. Per-tensor targets (fp8_tensor, nvfp4) first reduce the amax over each matrix.
// All math is the shared numerics.h (the spec's fp32 operation order); the inner loops are
// plain element loops the compiler vectorizes, and tiles are spread over torch's threads in
// dynamically claimed chunks (parallel_chunks; built with -fopenmp, see setup.py).
// On CPUs with AVX-512 (F/BW/VL/DQ) the hot loops run as the explicit v512:: versions below
// (lane-wise transcriptions of the same numerics.h functions, bit-identical; bf16 and E4M3 sources
// decoded inside the encode loops instead of through the scratch row); CKPTQ_CPU_ISA=generic forces
// the portable loops.
#include <Python.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* temporaries.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include "numerics.h"
#include "requantize.h"

namespace ckptq {
namespace {

using namespace num;

// ---------------------------------------------------------------- conversion tables
// Decode tables taken from torch itself, so the CPU kernels convert exactly as the reference's
// `.to(torch.float32)` does (NaN payloads included); and the bf16 bits torch's CPU conversion
// gives the canonical NaN (its vectorized path writes 0xFFFF where c10's scalar code writes 0x7FC0).
struct CpuTables {
  float e4m3[256];
  float e5m2[256];
  uint16_t bf16_nan;
};

const CpuTables& tables() {
  static const CpuTables t = [] {
    CpuTables t{};
    auto bytes = at::arange(256, at::TensorOptions().dtype(at::kInt)).to(at::kByte);
    auto a = bytes.view(at::kFloat8_e4m3fn).to(at::kFloat).contiguous();
    auto b = bytes.view(at::kFloat8_e5m2).to(at::kFloat).contiguous();
    std::memcpy(t.e4m3, a.data_ptr<float>(), sizeof(t.e4m3));
    std::memcpy(t.e5m2, b.data_ptr<float>(), sizeof(t.e5m2));
    auto probe = [](uint32_t bits) {
      auto x = at::full({64}, (int64_t)(int32_t)bits, at::TensorOptions().dtype(at::kInt)).view(at::kFloat);
      auto y = x.to(at::kBFloat16).contiguous();
      return (uint16_t)y.view(at::kShort).data_ptr<int16_t>()[63];
    };
    t.bf16_nan = probe(kCanonicalNaN);
    return t;
  }();
  return t;
}

// fp16 bits -> fp32 (exact for every non-NaN; NaN is canonicalized by the caller).
// c10::detail::fp16_ieee_to_fp32_value, branch-free.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * u2f(0x7800000u);  // * 2^-112
  const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
  return u2f(sign | (two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized)));
}

// fp32 -> fp16 bits as torch's CPU conversion (F16C vcvtps2ph, round to nearest even): the
// non-NaN path is c10::detail::fp16_ieee_from_fp32_value; a NaN keeps its sign and top payload
// bits with the quiet bit set, as vcvtps2ph does.
inline uint16_t f32_to_f16(float f) {
  const uint32_t w = f2u(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  float base = (u2f(w & 0x7FFFFFFFu) * u2f(0x77800000u)) * u2f(0x08800000u);  // * 2^112 * 2^-110
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  const uint32_t nan = 0x7E00u | ((w >> 13) & 0x3FFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

// fp32 -> bf16 bits, RNE; NaN (canonicalized first, numerics._canonical_nan) as torch converts it.
inline uint16_t f32_to_bf16(float f, uint16_t nan_bits) {
  const uint32_t u = f2u(f);
  const uint16_t rne = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return is_nan(f) ? nan_bits : rne;
}

// ---------------------------------------------------------------- vectorized row loops
// The element loops, compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time
// (GCC target_clones). Same IEEE fp32 operations in every version (-ffp-contract=off).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CKPTQ_NO_CLONES)
#define CKPTQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CKPTQ_CLONES
#endif

CKPTQ_CLONES void nvfp4_decode_pairs(const uint8_t* __restrict x, int64_t npairs, float m, float* __restrict o) {
  for (int64_t i = 0; i < npairs; ++i) {
    const uint32_t byte = x[i];
    o[2 * i] = e2m1_decode(byte & 0xFu) * m;
    o[2 * i + 1] = e2m1_decode(byte >> 4) * m;
  }
}

// Whole-chunk decodes of blocked sources: n elements from a block boundary, blocks of bk, one
// multiplier per block (mult[0] for the first block of the chunk).
CKPTQ_CLONES void nvfp4_decode_blocks(const uint8_t* __restrict x, int64_t n, const float* __restrict mult,
                                      float* __restrict o) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += 16) {
    const float m = mult[j];
    const int64_t np = std::min<int64_t>(16, n - c) / 2;
    for (int64_t i = 0; i < np; ++i) {
      const uint32_t byte = x[c / 2 + i];
      o[c + 2 * i] = e2m1_decode(byte & 0xFu) * m;
      o[c + 2 * i + 1] = e2m1_decode(byte >> 4) * m;
    }
  }
}

CKPTQ_CLONES void fp8_decode_blocks(const uint8_t* __restrict x, int64_t n, int64_t bk, const float* __restrict lut,
                                    const float* __restrict mult, float* __restrict o) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += bk) {
    const float m = mult[j];
    const int64_t len = std::min(bk, n - c);
    for (int64_t i = 0; i < len; ++i) o[c + i] = lut[x[c + i]] * m;
  }
}

CKPTQ_CLONES void fp8_decode_run(const uint8_t* __restrict x, int64_t n, const float* __restrict lut, float m,
                                 float* __restrict o) {
  for (int64_t i = 0; i < n; ++i) o[i] = lut[x[i]] * m;
}

CKPTQ_CLONES uint32_t seg_amax_bits(const float* __restrict v, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = abs_bits(v[i]);
    m = a > m ? a : m;
  }
  return m;
}

CKPTQ_CLONES void col_amax_bits(const float* __restrict v, int64_t n, uint32_t* __restrict cm) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = abs_bits(v[i]);
    cm[i] = a > cm[i] ? a : cm[i];
  }
}

CKPTQ_CLONES void cast_e4m3_row(const float* __restrict v, int64_t n, float mult, uint8_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = cast_e4m3(v[i] * mult);
}

CKPTQ_CLONES void cast_e5m2_row(const float* __restrict v, int64_t n, float mult, uint8_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = cast_e5m2(v[i] * mult);
}

// columnwise MXFP8: a multiplier per column
CKPTQ_CLONES void cast_e4m3_cols(const float* __restrict v, int64_t n, const float* __restrict mult,
                                 uint8_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = cast_e4m3(v[i] * mult[i]);
}

// Whole-chunk block loops: n elements in blocks of bk (the last one may be shorter), one
// parameter per block. One call per row chunk keeps the per-block overhead out of the hot path.
CKPTQ_CLONES void block_amax_row(const float* __restrict v, int64_t n, int64_t bk, uint32_t* __restrict out) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += bk) {
    const float* p = v + c;
    const int64_t len = std::min(bk, n - c);
    uint32_t m = 0;
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t a = abs_bits(p[i]);
      m = a > m ? a : m;
    }
    out[j] = m;
  }
}

CKPTQ_CLONES void e4m3_blocks(const float* __restrict v, int64_t n, int64_t bk, const float* __restrict mult,
                              uint8_t* __restrict out) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += bk) {
    const float m = mult[j];
    const int64_t len = std::min(bk, n - c);
    for (int64_t i = 0; i < len; ++i) out[c + i] = cast_e4m3(v[c + i] * m);
  }
}

CKPTQ_CLONES void e5m2_blocks(const float* __restrict v, int64_t n, int64_t bk, const float* __restrict mult,
                              uint8_t* __restrict out) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += bk) {
    const float m = mult[j];
    const int64_t len = std::min(bk, n - c);
    for (int64_t i = 0; i < len; ++i) out[c + i] = cast_e5m2(v[c + i] * m);
  }
}

// NVFP4, blocks of 16, n even: out holds n/2 bytes, element 2i in the low nibble.
CKPTQ_CLONES void nvfp4_blocks(const float* __restrict v, int64_t n, const float* __restrict enc,
                               uint8_t* __restrict out) {
  const int64_t full = n / 16;
  for (int64_t j = 0; j < full; ++j) {
    const float e = enc[j];
    const float* p = v + 16 * j;
    uint8_t code[16];
    for (int i = 0; i < 16; ++i) code[i] = nvfp4_code(p[i], e);
    for (int i = 0; i < 8; ++i) out[8 * j + i] = (uint8_t)(code[2 * i] | (code[2 * i + 1] << 4));
  }
  for (int64_t c = 16 * full; c < n; c += 2)
    out[c / 2] = (uint8_t)(nvfp4_code(v[c], enc[full]) | (nvfp4_code(v[c + 1], enc[full]) << 4));
}

CKPTQ_CLONES void f16_decode_row(const uint16_t* __restrict x, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(x[i]);
}

CKPTQ_CLONES void bf16_decode_row(const uint16_t* __restrict x, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i) out[i] = u2f((uint32_t)x[i] << 16);
}

// ---------------------------------------------------------------- AVX-512 row loops
// Explicit AVX-512 (F + BW + VL + DQ) versions of the hot loops, used when the CPU has them
// (checked once at run time, `use_avx512()`); every other machine, and CKPTQ_CPU_ISA=generic,
// runs the portable loops above. Each vector function is a lane-wise transcription of the scalar
// numerics.h function named in its comment: the same IEEE fp32 operations (mul, add, div, in the
// same order; no FMA), the same integer bit operations, selects written as masked blends. Where a
// select has NaN semantics the intrinsic's operand order reproduces it:
//   _mm512_max_ps(a, b) = a > b ? a : b,  _mm512_min_ps(a, b) = a < b ? a : b  (b if either is NaN),
// so max_ps(lo, x) is `x < lo ? lo : x` and min_ps(hi, x) is `x > hi ? hi : x` (clamp_keep_nan), and
// min_ps(q, FLT_MAX) is fmin_c(q, FLT_MAX) (a NaN q yields FLT_MAX). Tails use masked loads and
// stores (masked-off lanes load 0, whose abs bits never raise a max). The block scales of mxfp8
// and nvfp4 1x16 targets are computed for 16 blocks at once (no scalar work per block); those of
// larger blocks (fp8_block, nvfp4 16x16) stay scalar, one per 128..16K elements.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(CKPTQ_NO_AVX512)
#define CKPTQ_HAVE_AVX512 1
#define CKPTQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))

bool use_avx512() {
  static const bool on = [] {
    const char* isa = std::getenv("CKPTQ_CPU_ISA");  // "generic": the portable loops (tests, comparisons)
    if (isa != nullptr && std::strcmp(isa, "generic") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c");
  }();
  return on;
}

namespace v512 {

CKPTQ_AVX512 inline __m512i bcast(uint32_t u) { return _mm512_set1_epi32((int32_t)u); }
CKPTQ_AVX512 inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u));
}
CKPTQ_AVX512 inline __m512i abs_bits(__m512 x) { return _mm512_and_si512(_mm512_castps_si512(x), bcast(0x7FFFFFFFu)); }
using num::abs_bits;

// num::amax_from_bits: bits above +inf (NaN) -> the canonical NaN.
CKPTQ_AVX512 inline __m512 amax_from_bits(__m512i b) {
  return _mm512_castsi512_ps(
      _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(b, bcast(0x7F800000u)), b, bcast(kCanonicalNaN)));
}

// Lane j of the result = unsigned max over the 16 lanes of v[j] (a transposing max tree: 4 levels of
// two 2-source permutes + one max, 45 operations for 16 horizontal reductions).
CKPTQ_AVX512 inline __m512i hmax16(const __m512i* v) {
  const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i hi3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i hi4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_max_epu32(_mm512_permutex2var_epi32(v[2 * i], lo1, v[2 * i + 1]),
                            _mm512_permutex2var_epi32(v[2 * i], hi1, v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_max_epu32(_mm512_permutex2var_epi32(a[2 * i], lo2, a[2 * i + 1]),
                            _mm512_permutex2var_epi32(a[2 * i], hi2, a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_max_epu32(_mm512_permutex2var_epi32(b[2 * i], lo3, b[2 * i + 1]),
                            _mm512_permutex2var_epi32(b[2 * i], hi3, b[2 * i + 1]));
  return _mm512_max_epu32(_mm512_permutex2var_epi32(c[0], lo4, c[1]), _mm512_permutex2var_epi32(c[0], hi4, c[1]));
}

// num::cast_e4m3 (clamp_keep_nan to +-448, then e4m3_from_clamped): the E4M3 byte in each 32-bit lane.
// e4m3_from_clamped's `nrm == 0x7F ? 0x7E` select is left out: after the clamp |x| <= 448 =
// 0x43E00000, and the largest normal result, (0x43E00000 - (120 << 23) + 0x7FFFF + 0) >> 20, is 0x7E
// (smaller |x| give smaller or equal codes); NaN lanes, the only ones above 448, become 0x7F at the end.
// The sign byte is merged with one ternary-logic op (r | ((fb >> 24) & 0x80)).
CKPTQ_AVX512 inline __m512i cast_e4m3(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-kE4M3Max), x);
  x = _mm512_min_ps(_mm512_set1_ps(kE4M3Max), x);
  const __m512i fb = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(fb, bcast(0x7FFFFFFFu));
  constexpr uint32_t denorm_mask = 141u << 23;
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(bcast(denorm_mask)))),
      bcast(denorm_mask));
  const __m512i mant_odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), bcast(1u));
  const __m512i nrm = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, bcast(((uint32_t)(7 - 127) << 23) + 0x7FFFFu)), mant_odd), 20);
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, bcast(121u << 23)), nrm, sub);
  r = _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(fb, 24), bcast(0x80u), 0xF8);  // A | (B & C)
  return _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, bcast(0x7F800000u)), r, bcast(0x7Fu));
}

// Four vectors of byte values (0..255 in 32-bit lanes, elements 0-15, 16-31, 32-47, 48-63) -> 64
// contiguous bytes: two saturating packs (exact for 0..255) interleave the 128-bit lanes, one dword
// permute puts them back in order (3 shuffles instead of four 2-uop vpmovdb).
CKPTQ_AVX512 inline void store_bytes_x4(uint8_t* out, __m512i q0, __m512i q1, __m512i q2, __m512i q3) {
  const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(q0, q1), _mm512_packus_epi32(q2, q3));
  // byte lane L holds q0[4L..4L+3], q1[4L..], q2[4L..], q3[4L..]: output dword d = source dword 4 (d % 4) + d / 4
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi32(idx, b));
}

// Element loaders of the fused loops: 16 elements from index i as fp32 (masked-off lanes 0).
struct LoadF32 {  // the fp32 scratch row
  const float* p;
  CKPTQ_AVX512 __m512 operator()(int64_t i, __mmask16 k) const { return _mm512_maskz_loadu_ps(k, p + i); }
};
struct LoadBF16 {  // straight from a bf16 source row: bf16 -> fp32 is `bits << 16` (exact)
  const uint16_t* p;
  CKPTQ_AVX512 __m512 operator()(int64_t i, __mmask16 k) const {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p + i)), 16));
  }
};

// num::e8m0_from_f32 for v >= 0 or NaN (mx_scale_from_amax's argument).
CKPTQ_AVX512 inline __m512i e8m0_from_f32(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i exp = _mm512_and_si512(_mm512_srli_epi32(bits, 23), bcast(0xFFu));
  const __m512i man = _mm512_and_si512(bits, bcast(0x7FFFFFu));
  const __mmask16 man_nz = _mm512_test_epi32_mask(man, man);
  const __mmask16 not_fe = _mm512_cmpneq_epi32_mask(exp, bcast(0xFEu));
  const __mmask16 small_sub = _mm512_cmpeq_epi32_mask(exp, _mm512_setzero_si512()) &
                              _mm512_cmple_epu32_mask(man, bcast(0x400000u));
  const __mmask16 bump = man_nz & not_fe & (__mmask16)~small_sub;
  __m512i e = _mm512_mask_add_epi32(exp, bump, exp, bcast(1u));
  const __m512i abits = _mm512_and_si512(bits, bcast(0x7FFFFFFFu));
  e = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(abits, bcast(0x7F800000u)), e, bcast(254u));
  e = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), e, bcast(255u));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_EQ_OQ), e, _mm512_setzero_si512());
}

// num::e8m0_rcp: 2^(127 - e) (pow2_from_biased(254 - e), biased in [-1, 254]); 255 -> canonical NaN.
CKPTQ_AVX512 inline __m512 e8m0_rcp(__m512i e) {
  const __m512i b = _mm512_sub_epi32(bcast(254u), e);
  const __m512i normal = _mm512_slli_epi32(b, 23);
  const __m512i sh = _mm512_max_epi32(_mm512_add_epi32(b, bcast(22u)), _mm512_setzero_si512());
  const __m512i sub = _mm512_sllv_epi32(bcast(1u), sh);
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmpge_epi32_mask(b, bcast(1u)), sub, normal);
  r = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, bcast(255u)), r, bcast(kCanonicalNaN));
  return _mm512_castsi512_ps(r);
}

// num::nvfp4_code(x, enc) = e2m1_encode(x * enc): the 4-bit code in each 32-bit lane.
// Written with fewer vector ops than a literal transcription, same results for every input:
//  * e2m1_index's `nrm - 252` is folded into the rounding add ((bits + 0x1FFFFF + odd - (252 << 22))
//    >> 22): the lanes that use nrm have a >= 1.0 (bits >= 254 << 22), so the sum does not wrap;
//  * e2m1_encode's NaN select: a NaN product gives min_ps(NaN, 6) = 6 (index 7), so only its sign
//    bit must stay out, hence the sign (bit 3) is merged only into the non-NaN lanes (masked ternlog).
CKPTQ_AVX512 inline __m512i nvfp4_code(__m512 x, __m512 enc) {
  const __m512 p = _mm512_mul_ps(x, enc);
  const __m512i pb = _mm512_castps_si512(p);
  __m512 a = _mm512_castsi512_ps(_mm512_and_si512(pb, bcast(0x7FFFFFFFu)));
  a = _mm512_min_ps(a, _mm512_set1_ps(6.0f));  // a < 6 ? a : 6 (NaN -> 6)
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(a, _mm512_set1_ps(4194304.0f))),
                                       bcast(0x4A800000u));
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 22), bcast(1u));
  const __m512i nrm =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, bcast(0x1FFFFFu - (252u << 22))), odd), 22);
  const __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LT_OQ), nrm, sub);
  return _mm512_mask_ternarylogic_epi32(code, _mm512_cmp_ps_mask(p, p, _CMP_ORD_Q), _mm512_srli_epi32(pb, 28),
                                        bcast(8u), 0xF8);  // A | (B & C) where p is not NaN
}

// 16 codes (32-bit lanes, element 2i low nibble) -> 8 packed bytes.
CKPTQ_AVX512 inline __m128i pack_e2m1(__m512i code) {
  return _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28)));
}

// num::e2m1_decode of the 16 codes in the 8 bytes at x (element 2i = low nibble of byte i).
CKPTQ_AVX512 inline __m512 e2m1_values(const uint8_t* x, __mmask8 bytes) {
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                      -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512i w = _mm512_cvtepu8_epi64(_mm_maskz_loadu_epi8(bytes, x));  // byte i in 64-bit lane i
  const __m512i idx = _mm512_and_si512(_mm512_or_si512(w, _mm512_slli_epi64(w, 28)), bcast(0xFu));
  return _mm512_permutexvar_ps(idx, table);
}

// E4M3 bytes -> fp32 exactly as the torch table: the byte's 7 magnitude bits placed in an fp16 (same
// mantissa width at the top, exponent bias 15 instead of 7) convert exactly (vcvtph2ps), times 2^8
// (exact); NaN codes (0x7F, 0xFF) take the table's values.
// The sign-extended byte shifted left by 7 puts the magnitude in fp16 bits 7..14 and a sign copy in
// bit 15; clearing bit 14 (the byte's own sign bit) leaves the fp16 pattern.
CKPTQ_AVX512 inline __m512 e4m3_values(__m128i b, const float* lut) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xBF80));
  __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
  if (nan) {
    const __mmask16 neg = _mm_movepi8_mask(b);
    v = _mm512_mask_blend_ps(nan & (__mmask16)~neg, v, _mm512_set1_ps(lut[0x7F]));
    v = _mm512_mask_blend_ps(nan & neg, v, _mm512_set1_ps(lut[0xFF]));
  }
  return v;
}

// Loader of the fused loops for an E4M3 source with one decode multiplier per block of bk elements
// (fp8_block / mxfp8): x = float(code) * mult[block], the decode of fp8_decode_blocks. Chunks
// start on a block boundary and bk is a multiple of 16, so each 16-element load has one multiplier.
struct LoadE4M3 {
  const uint8_t* p;
  const float* mult;
  const float* lut;
  int shift;  // log2(bk)
  CKPTQ_AVX512 __m512 operator()(int64_t i, __mmask16 k) const {
    return _mm512_mul_ps(e4m3_values(_mm_maskz_loadu_epi8(k, p + i), lut), _mm512_set1_ps(mult[i >> shift]));
  }
};

// Amax bits of an MXFP8 row run straight from the codes (n from a block boundary, blocks of 32):
// E4M3 magnitudes are ordered as their 7-bit codes (NaN, 0x7F, is the largest), and rounding
// x * m is monotone in |x| for a multiplier m >= 0 or NaN, so max_i |x_i * m| = (max_i |x_i|) * m
// exactly: one bytewise max per block, then a decode and a multiply per block.
CKPTQ_AVX512 uint32_t mxfp8_amax_bits(const uint8_t* __restrict x, int64_t n, const uint8_t* __restrict e8,
                                      const float* lut) {
  uint32_t m = 0;
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  for (int64_t c = 0, j = 0; c < n; c += 64, j += 2) {
    const int64_t len = std::min<int64_t>(64, n - c);
    const __mmask64 k = len >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << len) - 1);
    __m512i v = _mm512_and_si512(_mm512_maskz_loadu_epi8(k, x + c), low7);
    // fold each 32-byte half (one block each) to its max byte in byte 0 of the half
    v = _mm512_max_epu8(v, _mm512_bsrli_epi128(v, 8));
    v = _mm512_max_epu8(v, _mm512_bsrli_epi128(v, 4));
    v = _mm512_max_epu8(v, _mm512_bsrli_epi128(v, 2));
    v = _mm512_max_epu8(v, _mm512_bsrli_epi128(v, 1));  // byte 0 of each 128-bit lane: its max
    alignas(64) uint8_t lane_max[64];
    _mm512_store_si512(lane_max, v);
    for (int64_t h = 0; h < 2 && c + 32 * h < n; ++h) {
      const uint8_t code = std::max(lane_max[32 * h], lane_max[32 * h + 16]);
      const uint32_t a = abs_bits(lut[code] * e8m0_to_f32(e8[j + h]));
      m = a > m ? a : m;
    }
  }
  return m;
}

// ---- decodes into the fp32 scratch row

CKPTQ_AVX512 void bf16_decode_row(const uint16_t* __restrict x, int64_t n, float* __restrict out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x + i));
    _mm512_mask_storeu_ps(out + i, k, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
}

// fp8_decode_blocks for the E4M3 table: o = lut[x] * mult[block].
CKPTQ_AVX512 void e4m3_decode_blocks(const uint8_t* __restrict x, int64_t n, int64_t bk, const float* lut,
                                     const float* __restrict mult, float* __restrict o) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += bk) {
    const __m512 m = _mm512_set1_ps(mult[j]);
    const int64_t len = std::min(bk, n - c);
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = lanes(len - i);
      const __m512 v = e4m3_values(_mm_maskz_loadu_epi8(k, x + c + i), lut);
      _mm512_mask_storeu_ps(o + c + i, k, _mm512_mul_ps(v, m));
    }
  }
}

// nvfp4_decode_blocks: blocks of 16 from a block boundary, n even.
CKPTQ_AVX512 void nvfp4_decode_blocks(const uint8_t* __restrict x, int64_t n, const float* __restrict mult,
                                      float* __restrict o) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += 16) {
    const int64_t len = std::min<int64_t>(16, n - c);
    const __mmask8 kb = (__mmask8)((1u << (len / 2)) - 1u);
    const __m512 v = _mm512_mul_ps(e2m1_values(x + c / 2, kb), _mm512_set1_ps(mult[j]));
    _mm512_mask_storeu_ps(o + c, lanes(len), v);
  }
}

// ---- reductions

CKPTQ_AVX512 uint32_t seg_amax_bits(const float* __restrict v, int64_t n) {
  __m512i m = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16)
    m = _mm512_max_epu32(m, abs_bits(_mm512_maskz_loadu_ps(lanes(n - i), v + i)));
  return _mm512_reduce_max_epu32(m);
}

// amax bits of a bf16 run straight from the 16-bit patterns: bf16 -> fp32 is `bits << 16`, so the
// uint max of (bits & 0x7FFF) shifted back is the uint max of the fp32 abs bits (NaN included).
CKPTQ_AVX512 uint32_t bf16_amax_bits(const uint16_t* __restrict x, int64_t n) {
  __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
  const __m512i mask = _mm512_set1_epi16(0x7FFF);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), mask));
    m1 = _mm512_max_epu16(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 32), mask));
  }
  for (; i < n; i += 32) {
    const __mmask32 k = n - i >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (n - i)) - 1u);
    m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_maskz_loadu_epi16(k, x + i), mask));
  }
  m0 = _mm512_max_epu16(m0, m1);
  const __m512i lo = _mm512_and_si512(m0, bcast(0xFFFFu)), hi = _mm512_srli_epi32(m0, 16);
  return _mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi)) << 16;
}

template <class L>
CKPTQ_AVX512 void col_amax_bits(L ld, int64_t n, uint32_t* __restrict cm) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __m512i a = abs_bits(ld(i, k));
    _mm512_mask_storeu_epi32(cm + i, k, _mm512_max_epu32(a, _mm512_maskz_loadu_epi32(k, cm + i)));
  }
}

// ---- encodes from the fp32 scratch row

// e4m3_blocks: out = cast_e4m3(x * mult[block]); runs of 64 inside a block use one 64-byte store.
template <class L>
CKPTQ_AVX512 void e4m3_blocks(L ld, int64_t n, int64_t bk, const float* __restrict mult, uint8_t* __restrict out) {
  const __mmask16 all = 0xFFFF;
  for (int64_t j = 0, c = 0; c < n; ++j, c += bk) {
    const __m512 m = _mm512_set1_ps(mult[j]);
    const int64_t len = std::min(bk, n - c);
    int64_t i = 0;
    for (; i + 64 <= len; i += 64)
      store_bytes_x4(out + c + i, cast_e4m3(_mm512_mul_ps(ld(c + i, all), m)),
                     cast_e4m3(_mm512_mul_ps(ld(c + i + 16, all), m)), cast_e4m3(_mm512_mul_ps(ld(c + i + 32, all), m)),
                     cast_e4m3(_mm512_mul_ps(ld(c + i + 48, all), m)));
    for (; i < len; i += 16) {
      const __mmask16 k = lanes(len - i);
      _mm_mask_storeu_epi8(out + c + i, k, _mm512_cvtepi32_epi8(cast_e4m3(_mm512_mul_ps(ld(c + i, k), m))));
    }
  }
}

CKPTQ_AVX512 void e4m3_row(const float* __restrict v, int64_t n, float mult, uint8_t* __restrict out) {
  const __m512 m = _mm512_set1_ps(mult);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    _mm_mask_storeu_epi8(out + i, k, _mm512_cvtepi32_epi8(cast_e4m3(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, v + i), m))));
  }
}

// nvfp4_blocks: codes with one encode multiplier per block of 16, n even.
CKPTQ_AVX512 void nvfp4_blocks(const float* __restrict v, int64_t n, const float* __restrict enc,
                               uint8_t* __restrict out) {
  for (int64_t j = 0, c = 0; c < n; ++j, c += 16) {
    const int64_t len = std::min<int64_t>(16, n - c);
    const __m512i code = nvfp4_code(_mm512_maskz_loadu_ps(lanes(len), v + c), _mm512_set1_ps(enc[j]));
    _mm_mask_storeu_epi8(out + c / 2, (__mmask16)((1u << (len / 2)) - 1u), pack_e2m1(code));
  }
}

// MXFP8 1x32 of a row chunk (n <= 512 from a block boundary): block amaxes, E8M0 scales
// (mx_scale_from_amax, e8m0_rcp) for 16 blocks at once, then the E4M3 data.
template <class L>
CKPTQ_AVX512 void mxfp8_chunk(L ld, int64_t n, uint8_t* __restrict data, uint8_t* __restrict scale) {
  const int64_t nb = cdiv(n, 32);
  __m512i bm[16];
  for (int64_t j = 0; j < 16; ++j) {
    const int64_t c = 32 * j;
    if (c >= n) {
      bm[j] = _mm512_setzero_si512();
      continue;
    }
    const __m512i a0 = abs_bits(ld(c, lanes(n - c)));
    const __m512i a1 = abs_bits(ld(c + 16, lanes(n - c - 16)));
    bm[j] = _mm512_max_epu32(a0, a1);
  }
  const __m512 amax = amax_from_bits(hmax16(bm));
  const __m512i e = e8m0_from_f32(_mm512_mul_ps(amax, _mm512_castsi512_ps(bcast(kInv448Bits))));
  _mm_mask_storeu_epi8(scale, lanes(nb), _mm512_cvtepi32_epi8(e));
  alignas(64) float mult[16];
  _mm512_store_ps(mult, e8m0_rcp(e));
  const __mmask16 all = 0xFFFF;
  int64_t j = 0;
  for (; 32 * j + 64 <= n; j += 2) {  // two whole blocks: one 64-byte store
    const int64_t c = 32 * j;
    const __m512 m0 = _mm512_set1_ps(mult[j]), m1 = _mm512_set1_ps(mult[j + 1]);
    store_bytes_x4(data + c, cast_e4m3(_mm512_mul_ps(ld(c, all), m0)), cast_e4m3(_mm512_mul_ps(ld(c + 16, all), m0)),
                   cast_e4m3(_mm512_mul_ps(ld(c + 32, all), m1)), cast_e4m3(_mm512_mul_ps(ld(c + 48, all), m1)));
  }
  for (; j < nb; ++j) {
    const __m512 m = _mm512_set1_ps(mult[j]);
    for (int64_t c = 32 * j; c < std::min<int64_t>(n, 32 * j + 32); c += 16) {
      const __mmask16 k = lanes(n - c);
      _mm_mask_storeu_epi8(data + c, k, _mm512_cvtepi32_epi8(cast_e4m3(_mm512_mul_ps(ld(c, k), m))));
    }
  }
}

// NVFP4 1x16 of a row chunk (n <= 512, even, from a block boundary), 16 blocks at a time: block amaxes,
// s = cast_e4m3(amax * S_enc/6) (nvfp4_block_scale), enc = fmin(1 / (float(s) * S_dec), FLT_MAX)
// (nvfp4_enc; float(s) from the torch table), then the codes.
template <class L>
CKPTQ_AVX512 void nvfp4_chunk(L ld, int64_t n, const Nvfp4Tensor& t, const float* e4m3_lut, uint8_t* __restrict data,
                              uint8_t* __restrict scale) {
  for (int64_t g = 0; g < n; g += 256) {
    const int64_t ng = std::min<int64_t>(256, n - g), nb = cdiv(ng, 16);
    __m512i bm[16];
    __m512 xs[16];  // the group's 16 blocks, kept in registers between the amax and the encode
    for (int64_t j = 0; j < 16; ++j) {
      xs[j] = ld(g + 16 * j, lanes(ng - 16 * j));
      bm[j] = abs_bits(xs[j]);
    }
    const __m512 amax = amax_from_bits(hmax16(bm));
    const __m512i s = cast_e4m3(_mm512_mul_ps(amax, _mm512_set1_ps(t.s_enc_div6)));
    _mm_mask_storeu_epi8(scale + g / 16, lanes(nb), _mm512_cvtepi32_epi8(s));
    const __m512 sf = _mm512_i32gather_ps(s, e4m3_lut, 4);
    const __m512 q = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(sf, _mm512_set1_ps(t.s_dec)));
    alignas(64) float enc[16];
    _mm512_store_ps(enc, _mm512_min_ps(q, _mm512_set1_ps(flt_max())));
    if (ng == 256) {  // 16 whole blocks: 8 packed bytes each, stored 64 bytes at a time
      for (int64_t j = 0; j < 16; j += 8) {
        __m128i p[8];
        for (int i = 0; i < 8; ++i) p[i] = pack_e2m1(nvfp4_code(xs[j + i], _mm512_set1_ps(enc[j + i])));
        const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_unpacklo_epi64(p[2], p[3]),
                                                                                      _mm_unpacklo_epi64(p[0], p[1]))),
                                              _mm256_set_m128i(_mm_unpacklo_epi64(p[6], p[7]), _mm_unpacklo_epi64(p[4], p[5])), 1);
        _mm512_storeu_si512(data + (g + 16 * j) / 2, lo);
      }
      continue;
    }
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t len = std::min<int64_t>(16, ng - 16 * j);
      const __m512i code = nvfp4_code(xs[j], _mm512_set1_ps(enc[j]));
      _mm_mask_storeu_epi8(data + (g + 16 * j) / 2, (__mmask16)((1u << (len / 2)) - 1u), pack_e2m1(code));
    }
  }
}

// ---- high-precision outputs

// f32_to_bf16 (RNE; NaN -> nan_bits, the caller's canonical NaN conversion).
CKPTQ_AVX512 void bf16_out_row(const float* __restrict v, int64_t n, uint16_t nan_bits, uint16_t* __restrict d) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(k, v + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), bcast(1u));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bcast(0x7FFFu)), odd), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, bcast(nan_bits));
    _mm256_mask_storeu_epi16(d + i, k, _mm512_cvtepi32_epi16(r));
  }
}

// nvfp4 -> bf16 in one pass (nvfp4_decode_blocks then bf16_out_row, without the scratch row): n
// even, from a block boundary, one decode multiplier per block of 16. Two blocks' 32 results are
// packed with one saturating pack (RNE results are 0..0xFFFF, exact) and one qword permute.
CKPTQ_AVX512 inline __m512i bf16_bits(__m512 x, __m512i nan_bits) {  // f32_to_bf16, 16 lanes
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), bcast(1u));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bcast(0x7FFFu)), odd), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, nan_bits);
}

CKPTQ_AVX512 void nvfp4_to_bf16(const uint8_t* __restrict x, int64_t n, const float* __restrict mult, uint16_t nan,
                                uint16_t* __restrict out) {
  const __m512i nan_bits = bcast(nan);
  const __m512i fix = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  int64_t c = 0, j = 0;
  for (; c + 32 <= n; c += 32, j += 2) {
    const __m512i r0 = bf16_bits(_mm512_mul_ps(e2m1_values(x + c / 2, 0xFF), _mm512_set1_ps(mult[j])), nan_bits);
    const __m512i r1 = bf16_bits(_mm512_mul_ps(e2m1_values(x + c / 2 + 8, 0xFF), _mm512_set1_ps(mult[j + 1])), nan_bits);
    // packus: 128-bit lane L = r0[4L..4L+3], r1[4L..4L+3] -> qword order 0,2,4,6 (r0) then 1,3,5,7 (r1)
    _mm512_storeu_si512(out + c, _mm512_permutexvar_epi64(fix, _mm512_packus_epi32(r0, r1)));
  }
  for (; c < n; c += 16, ++j) {
    const int64_t len = std::min<int64_t>(16, n - c);
    const __m512 v = _mm512_mul_ps(e2m1_values(x + c / 2, (__mmask8)((1u << (len / 2)) - 1u)), _mm512_set1_ps(mult[j]));
    _mm256_mask_storeu_epi16(out + c, lanes(len), _mm512_cvtepi32_epi16(bf16_bits(v, nan_bits)));
  }
}

}  // namespace v512
#else
inline bool use_avx512() { return false; }
#endif

// --------------------------------------------------------------------------- decode
struct SrcCpu {
  Fmt f;
  const uint8_t* data;
  const float* lut;        // fp8 / mxfp8 element table
  const float* e4m3;       // nvfp4 scale table
  const float* sc_f32;     // fp8 scale_inv grid
  const uint8_t* sc_u8;    // mxfp8 / mxfp4 e8m0, nvfp4 e4m3 scale grid
  const float* amax;       // nvfp4 per matrix
  int64_t M, K, sbm, sbk, srows, scols;
  bool avx512;             // use the v512:: loops (use_avx512())
  bool lut_e4m3;           // fp8 elements are E4M3 (the v512 decode handles this table only)
};

SrcCpu make_src(const Plan& p) {
  const CpuTables& tb = tables();
  SrcCpu s{};
  s.f = p.sf;
  s.data = (const uint8_t*)p.s_data.data_ptr();
  s.M = p.M;
  s.K = p.K;
  s.sbm = p.sbm;
  s.sbk = p.sbk;
  s.srows = p.s_srows;
  s.scols = p.s_scols;
  s.lut = p.s_e5m2 ? tb.e5m2 : tb.e4m3;
  s.lut_e4m3 = !p.s_e5m2;
  s.avx512 = use_avx512();
  s.e4m3 = tb.e4m3;
  if (p.sf == Fmt::FP8_TENSOR || p.sf == Fmt::FP8_BLOCK) s.sc_f32 = p.s_scale.data_ptr<float>();
  if (p.sf == Fmt::MXFP8 || fmt_is_fp4(p.sf)) s.sc_u8 = (const uint8_t*)p.s_scale.data_ptr();
  if (p.sf == Fmt::NVFP4) s.amax = p.s_amax.data_ptr<float>();
  return s;
}

// Decode n elements of row r of matrix b, from column c0, into out (fp32, the reference's
// dequantize value: fp32 math, before any cast to the requested dtype).
void decode_row(const SrcCpu& s, int64_t b, int64_t r, int64_t c0, int64_t n, float* __restrict out) {
  const int64_t row = b * s.M + r;
  switch (s.f) {
    case Fmt::F32: {
      std::memcpy(out, (const float*)s.data + row * s.K + c0, n * sizeof(float));
      return;
    }
    case Fmt::BF16: {  // exact; every later use of a NaN canonicalizes it (casts, amax, outputs)
#ifdef CKPTQ_HAVE_AVX512
      if (s.avx512) return v512::bf16_decode_row((const uint16_t*)s.data + row * s.K + c0, n, out);
#endif
      bf16_decode_row((const uint16_t*)s.data + row * s.K + c0, n, out);
      return;
    }
    case Fmt::F16: {
      f16_decode_row((const uint16_t*)s.data + row * s.K + c0, n, out);
      return;
    }
    default:
      break;
  }
  // Blocked sources: walk the row in runs that share one source scale.
  const int64_t srow = (b * s.srows + r / s.sbm) * s.scols;
  const int64_t end = c0 + n;
  constexpr int64_t kMaxBlocks = 128;
  if (c0 % s.sbk == 0 && cdiv(n, s.sbk) <= kMaxBlocks && (!fmt_is_fp4(s.f) || n % 2 == 0) &&
      (s.f != Fmt::MXFP4 || cdiv(n, 16) <= kMaxBlocks)) {
    // Common case: the chunk starts on a block boundary; multipliers first, then one loop.
    float mult[kMaxBlocks];
    const int64_t nb = cdiv(n, s.sbk), b0 = c0 / s.sbk;
    switch (s.f) {
      case Fmt::FP8_TENSOR:
      case Fmt::FP8_BLOCK:
        for (int64_t j = 0; j < nb; ++j) mult[j] = s.sc_f32[srow + b0 + j];
        break;
      case Fmt::MXFP8:
        for (int64_t j = 0; j < nb; ++j) mult[j] = e8m0_to_f32(s.sc_u8[srow + b0 + j]);
        break;
      case Fmt::NVFP4: {
        const float amax = s.amax[b];
        for (int64_t j = 0; j < nb; ++j) mult[j] = nvfp4_dec_mult(s.e4m3[s.sc_u8[srow + b0 + j]], amax);
#ifdef CKPTQ_HAVE_AVX512
        if (s.avx512) return v512::nvfp4_decode_blocks(s.data + row * (s.K / 2) + c0 / 2, n, mult, out);
#endif
        nvfp4_decode_blocks(s.data + row * (s.K / 2) + c0 / 2, n, mult, out);
        return;
      }
      case Fmt::MXFP4:  // nvfp4's portable loop, one multiplier per 16 elements (two per 1x32 block)
        for (int64_t j = 0; j < cdiv(n, 16); ++j) mult[j] = e8m0_to_f32(s.sc_u8[srow + b0 + j / 2]);
        nvfp4_decode_blocks(s.data + row * (s.K / 2) + c0 / 2, n, mult, out);
        return;
      default:
        break;
    }
#ifdef CKPTQ_HAVE_AVX512
    if (s.avx512 && s.lut_e4m3) return v512::e4m3_decode_blocks(s.data + row * s.K + c0, n, s.sbk, s.lut, mult, out);
#endif
    fp8_decode_blocks(s.data + row * s.K + c0, n, s.sbk, s.lut, mult, out);
    return;
  }
  for (int64_t c = c0; c < end;) {
    const int64_t blk = c / s.sbk;
    const int64_t e = std::min(end, (blk + 1) * s.sbk);
    float* __restrict o = out + (c - c0);
    const int64_t len = e - c;
    switch (s.f) {
      case Fmt::FP8_TENSOR:
      case Fmt::FP8_BLOCK:  // x = float(data) * scale_inv[block]
        fp8_decode_run(s.data + row * s.K + c, len, s.lut, s.sc_f32[srow + blk], o);
        break;
      case Fmt::MXFP8:  // x = float(data) * 2^(scale - 127)
        fp8_decode_run(s.data + row * s.K + c, len, s.lut, e8m0_to_f32(s.sc_u8[srow + blk]), o);
        break;
      case Fmt::NVFP4:  // x = e2m1(code) * ((float(s) * amax) * (1/2688))
      case Fmt::MXFP4: {  // x = e2m1(code) * 2^(scale - 127)
        const float m = s.f == Fmt::NVFP4 ? nvfp4_dec_mult(s.e4m3[s.sc_u8[srow + blk]], s.amax[b])
                                          : e8m0_to_f32(s.sc_u8[srow + blk]);
        const uint8_t* x = s.data + row * (s.K / 2);
        if ((c & 1) == 0 && (len & 1) == 0) {
          nvfp4_decode_pairs(x + c / 2, len / 2, m, o);
        } else {
          for (int64_t i = 0; i < len; ++i) {
            const int64_t col = c + i;
            o[i] = e2m1_decode((x[col >> 1] >> ((col & 1) * 4)) & 0xFu) * m;
          }
        }
        break;
      }
      default:
        break;
    }
    c = e;
  }
}

// at::parallel_for splits [begin, end) into one static range per thread, so a call takes as long as
// its slowest thread: on a shared machine, where another process holds one core, two threads take
// as long as one. This keeps torch's thread count and its rules for running inline (range within
// one grain, one thread, inside a parallel region) but hands out grain-sized chunks dynamically
// (an atomic counter, up to 32 chunks per thread), so a thread that gets more CPU takes more
// chunks. The kernels' chunks are independent (disjoint outputs; amaxes combined with an atomic
// max), so the bytes do not depend on which thread ran which chunk.
template <class F>
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int nt = at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
#if defined(_OPENMP)
  if (n > grain && nt > 1 && !at::in_parallel_region() && !omp_in_parallel()) {
    const int64_t chunk = std::max(grain, cdiv(n, 32 * (int64_t)nt));
    const int64_t nchunks = cdiv(n, chunk);
    std::atomic<int64_t> next{0};
    std::exception_ptr err;
    std::atomic<bool> failed{false};
#pragma omp parallel num_threads(nt)
    {
      for (;;) {
        const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
        if (c >= nchunks || failed.load(std::memory_order_relaxed)) break;
        try {
          f(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
        } catch (...) {
#pragma omp critical(ckptq_parallel_chunks)
          if (!failed.exchange(true)) err = std::current_exception();
        }
      }
    }
    if (err) std::rethrow_exception(err);
    return;
  }
#endif
  (void)nt;
  f(begin, end);
}

inline void atomic_max(std::atomic<uint32_t>& a, uint32_t v) {
  uint32_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

constexpr int64_t kChunk = 1024;  // row chunk of the element-wise passes (floats of scratch)

// amax over each matrix of the decoded source (numerics._matrix_amax): B fp32 values, NaN
// canonical.
std::vector<float> tensor_amax(const SrcCpu& s, int64_t B) {
  const int64_t M = s.M, K = s.K;
  TORCH_CHECK(M > 0 && K > 0, "ckptq: cannot take the per-tensor amax of an empty (", M, ", ", K, ") matrix");
  std::vector<std::atomic<uint32_t>> acc(B);
  for (auto& a : acc) a.store(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / K);
  parallel_chunks(0, B * M, grain, [&](int64_t beg, int64_t end) {
    std::vector<float> buf(std::min(kChunk, K));
    int64_t cur = beg / M;
    uint32_t m = 0;
    for (int64_t row = beg; row < end; ++row) {
      const int64_t b = row / M, r = row % M;
      if (b != cur) {
        atomic_max(acc[cur], m);
        m = 0;
        cur = b;
      }
      for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
        const int64_t n = std::min(kChunk, K - c0);
        uint32_t a;
#ifdef CKPTQ_HAVE_AVX512
        if (s.avx512 && s.f == Fmt::BF16) {  // straight from the bf16 bits, no decode
          a = v512::bf16_amax_bits((const uint16_t*)s.data + (b * M + r) * K + c0, n);
        } else if (s.avx512 && s.f == Fmt::MXFP8) {  // from the codes: one decode per block
          a = v512::mxfp8_amax_bits(s.data + (b * M + r) * K + c0, n, s.sc_u8 + (b * M + r) * s.scols + c0 / 32, s.lut);
        } else if (s.avx512) {
          decode_row(s, b, r, c0, n, buf.data());
          a = v512::seg_amax_bits(buf.data(), n);
        } else
#endif
        {
          decode_row(s, b, r, c0, n, buf.data());
          a = seg_amax_bits(buf.data(), n);
        }
        m = a > m ? a : m;
      }
    }
    atomic_max(acc[cur], m);
  });
  std::vector<float> out(B);
  for (int64_t b = 0; b < B; ++b) out[b] = amax_from_bits(acc[b].load());
  return out;
}

// ---------------------------------------------------------------------------- encode
inline void cast_fp8_row(const float* v, int64_t n, float mult, uint8_t* out, bool e5m2) {
  if (e5m2)
    cast_e5m2_row(v, n, mult, out);
  else
    cast_e4m3_row(v, n, mult, out);
}

CKPTQ_CLONES void f32_out_row(const float* __restrict v, int64_t n, float* __restrict d) {
  for (int64_t i = 0; i < n; ++i) d[i] = canonical_nan(v[i]);
}

CKPTQ_CLONES void bf16_out_row(const float* __restrict v, int64_t n, uint16_t nan_bits, uint16_t* __restrict d) {
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(v[i], nan_bits);
}

CKPTQ_CLONES void f16_out_row(const float* __restrict v, int64_t n, uint16_t* __restrict d) {
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(canonical_nan(v[i]));
}

// Elementwise targets: hp formats and fp8_tensor (one scale per matrix).
void run_elementwise(const Plan& p, const SrcCpu& s, const std::vector<float>& tensor_scale) {
  const int64_t M = p.M, K = p.K, B = p.B;
  if (B * M == 0 || K == 0) return;
  void* out = p.outs[0].data_ptr();
  const CpuTables& tb = tables();
  const int64_t grain = std::max<int64_t>(1, 32768 / K);
#ifdef CKPTQ_HAVE_AVX512
  if (s.avx512 && s.f == Fmt::NVFP4 && p.df == Fmt::BF16) {  // one fused pass, no scratch row
    parallel_chunks(0, B * M, grain, [&](int64_t beg, int64_t end) {
      float mult[kChunk / 16];
      for (int64_t row = beg; row < end; ++row) {
        const int64_t b = row / M, r = row % M;
        const int64_t srow = (b * s.srows + r / s.sbm) * s.scols;
        const float amax = s.amax[b];
        for (int64_t c0 = 0; c0 < K; c0 += kChunk) {  // K is even (two codes per byte), kChunk a multiple of 16
          const int64_t n = std::min(kChunk, K - c0), nb = cdiv(n, 16);
          for (int64_t j = 0; j < nb; ++j) mult[j] = nvfp4_dec_mult(s.e4m3[s.sc_u8[srow + c0 / 16 + j]], amax);
          v512::nvfp4_to_bf16(s.data + row * (K / 2) + c0 / 2, n, mult, tb.bf16_nan, (uint16_t*)out + row * K + c0);
        }
      }
    });
    return;
  }
#endif
  parallel_chunks(0, B * M, grain, [&](int64_t beg, int64_t end) {
    std::vector<float> buf(std::min(kChunk, K));
    float* v = buf.data();
    for (int64_t row = beg; row < end; ++row) {
      const int64_t b = row / M, r = row % M;
      for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
        const int64_t n = std::min(kChunk, K - c0);
        decode_row(s, b, r, c0, n, v);
        const int64_t o = row * K + c0;
        switch (p.df) {  // dequantize: fp32 values (NaN canonical), cast at the end
          case Fmt::F32:
            f32_out_row(v, n, (float*)out + o);
            break;
          case Fmt::BF16:
#ifdef CKPTQ_HAVE_AVX512
            if (s.avx512) {
              v512::bf16_out_row(v, n, tb.bf16_nan, (uint16_t*)out + o);
              break;
            }
#endif
            bf16_out_row(v, n, tb.bf16_nan, (uint16_t*)out + o);
            break;
          case Fmt::F16:
            f16_out_row(v, n, (uint16_t*)out + o);
            break;
          case Fmt::FP8_TENSOR:  // data = sat_rne(x * scale)
#ifdef CKPTQ_HAVE_AVX512
            if (s.avx512 && !p.d_e5m2) {
              v512::e4m3_row(v, n, tensor_scale[b], (uint8_t*)out + o);
              break;
            }
#endif
            cast_fp8_row(v, n, tensor_scale[b], (uint8_t*)out + o, p.d_e5m2);
            break;
          default:
            TORCH_INTERNAL_ASSERT(false);
        }
      }
    }
  });
}

// Blocked targets: fp8_block (bm, bk), mxfp8 (1, 32) [+ (32, 1) columnwise], nvfp4 (1|16, 16),
// mxfp4 (1, 32; portable loops only: the v512 paths below are never taken for it).
void run_blocked(const Plan& p, const SrcCpu& s, const std::vector<Nvfp4Tensor>& nvt) {
  const int64_t M = p.M, K = p.K, B = p.B;
  if (B * M == 0 || K == 0) return;
  const int64_t bm = p.bm, bk = p.bk;
  const bool cw = p.columnwise;
  const int64_t TR = cw ? 32 : bm;                     // tile rows
  // Tile cols (whole blocks): 512 for one-row tiles. Tiles of bm > 1 rows on the v512 path span up to
  // 4096 columns, so that pass 1 streams whole row segments (few long sequential runs for the
  // hardware prefetchers rather than bm short ones per tile) while the band stays in L2 for pass 2.
  const int64_t W = (bm > 1 && use_avx512()) ? std::max(bk, std::min(cdiv(K, bk), std::max<int64_t>(1, 4096 / bk)) * bk)
                                             : (bk >= 512 ? bk : bk * (512 / bk));
  const int64_t ntr = cdiv(M, TR), ntc = cdiv(K, W);
  const int64_t nsr = cdiv(M, bm), nsc = cdiv(K, bk);  // rowwise scale grid per matrix
  const int64_t ntiles = B * ntr * ntc;
  const Fmt df = p.df;
  const float fp8_max = p.d_e5m2 ? kE5M2Max : kE4M3Max;
  const float* e4m3 = tables().e4m3;
  uint8_t* data = (uint8_t*)p.outs[0].data_ptr();
  void* scale = p.outs[1].data_ptr();
  uint8_t* cw_data = cw ? (uint8_t*)p.outs[2].data_ptr() : nullptr;
  uint8_t* cw_scale = cw ? (uint8_t*)p.outs[3].data_ptr() : nullptr;
  const int64_t data_row = fmt_is_fp4(df) ? K / 2 : K;  // bytes per row of data

  // Block amax -> (encode multiplier, scale written to the output).
  auto block_params = [&](int64_t b, int64_t rb, int64_t cb, uint32_t amax_bits) -> float {
    const float amax = amax_from_bits(amax_bits);
    const int64_t si = (b * nsr + rb) * nsc + cb;
    switch (df) {
      case Fmt::FP8_BLOCK: {  // scale rule of fp8_scale_from_amax; scale_inv = 1 / scale
        const float sc = fp8_scale_from_amax(amax, fp8_max, p.pow2, p.eps);
        ((float*)scale)[si] = 1.0f / sc;
        return sc;
      }
      case Fmt::MXFP8: {  // e = e8m0(amax * (1/448)); multiplier 2^(127 - e)
        const uint8_t e = mx_scale_from_amax(amax);
        ((uint8_t*)scale)[si] = e;
        return e8m0_rcp(e);
      }
      case Fmt::MXFP4: {  // e = the scale rule's E8M0 of amax; multiplier 2^(127 - e)
        const uint8_t e = mxfp4_scale_from_amax(amax, p.mx_rule);
        ((uint8_t*)scale)[si] = e;
        return e8m0_rcp(e);
      }
      case Fmt::NVFP4: {  // s = e4m3(amax * (S_enc / 6)); enc = fminf(1 / (s * S_dec), FLT_MAX)
        const uint8_t sb = nvfp4_block_scale(amax, nvt[b]);
        ((uint8_t*)scale)[si] = sb;
        return nvfp4_enc(e4m3[sb], nvt[b]);
      }
      default:
        TORCH_INTERNAL_ASSERT(false);
    }
    return 0.0f;
  };
  // Encode one row chunk of n elements at column c with one multiplier per block.
  const bool vx = s.avx512 && df != Fmt::MXFP4;  // the v512 loops of the target (none for mxfp4)
  auto encode = [&](const float* v, int64_t n, const float* mult, int64_t row, int64_t c) {
#ifdef CKPTQ_HAVE_AVX512
    if (vx && df == Fmt::NVFP4) return v512::nvfp4_blocks(v, n, mult, data + row * data_row + c / 2);
    if (vx && !(df == Fmt::FP8_BLOCK && p.d_e5m2))
      return v512::e4m3_blocks(v512::LoadF32{v}, n, bk, mult, data + row * data_row + c);
#endif
    if (df == Fmt::MXFP4) {  // nvfp4's portable loop (code = nvfp4_code(x, mult)) with one multiplier
      float m16[512 / 16];   // per 16 elements: two per 1x32 block (n <= W = 512)
      for (int64_t j = 0; j < cdiv(n, 16); ++j) m16[j] = mult[j / 2];
      nvfp4_blocks(v, n, m16, data + row * data_row + c / 2);
    } else if (df == Fmt::NVFP4)
      nvfp4_blocks(v, n, mult, data + row * data_row + c / 2);
    else if (df == Fmt::FP8_BLOCK && p.d_e5m2)
      e5m2_blocks(v, n, bk, mult, data + row * data_row + c);
    else
      e4m3_blocks(v, n, bk, mult, data + row * data_row + c);
  };

  // ~32K elements per task (tiles hold TR x min(W, K) elements; small matrices run inline)
  const int64_t grain = std::max<int64_t>(1, 32768 / (TR * std::min(W, K)));
  parallel_chunks(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(W);
    std::vector<uint32_t> amax(cdiv(W, bk)), ramax, camax, colmax;
    std::vector<float> mult(cdiv(W, bk)), rmult, cmult;
    float* v = buf.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (ntr * ntc), tr = (t / ntc) % ntr, tc = t % ntc;
      const int64_t r0 = tr * TR, r1 = std::min(M, r0 + TR);
      const int64_t c0 = tc * W, c1 = std::min(K, c0 + W), n = c1 - c0;
      const int64_t nbc = cdiv(n, bk), cb0 = c0 / bk;
      const int64_t nbr = cdiv(r1 - r0, bm);
      if (bm > 1) ramax.assign(nbr * nbc, 0u);
      if (cw) camax.assign(n, 0u);
      // v512, blocks of bm > 1 rows (the tile is one block row, TR = bm): per-column amaxes over the
      // rows first (a vertical max, no horizontal reduction per row), reduced per block at the end.
      const bool colwise_blocks = vx && bm > 1 && TR == bm;
      if (colwise_blocks) colmax.assign(n, 0u);
      // v512 with a bf16 source (and no columnwise copy, whose loop reads the scratch row): the fused
      // loops read the bf16 row itself (LoadBF16), no scratch row is written.
      const bool direct_bf16 = vx && s.f == Fmt::BF16 && !cw;
      // ... and an E4M3 source whose blocks tile the chunk in powers of two >= 16 decodes in the loader.
      const bool direct_e4m3 = vx && !cw && s.lut_e4m3 &&
                               (s.f == Fmt::MXFP8 || s.f == Fmt::FP8_BLOCK || s.f == Fmt::FP8_TENSOR) &&
                               s.sbk % 16 == 0 && (s.sbk & (s.sbk - 1)) == 0 && W <= 512 && W % s.sbk == 0;
      // Pass 1: block amaxes; blocks of one row are encoded at once.
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t row = b * M + r;
#ifdef CKPTQ_HAVE_AVX512
        if (vx && (bm > 1 || df != Fmt::FP8_BLOCK)) {
          // mxfp8 / nvfp4 1xN: amaxes, scales and data of the chunk in one call; bm > 1: column amaxes
          auto go = [&](auto ld) {
            if (bm == 1 && df == Fmt::MXFP8) {
              v512::mxfp8_chunk(ld, n, data + row * data_row + c0, (uint8_t*)scale + (b * nsr + r) * nsc + cb0);
              if (cw) v512::col_amax_bits(ld, n, camax.data());
            } else if (bm == 1) {
              v512::nvfp4_chunk(ld, n, nvt[b], e4m3, data + row * data_row + c0 / 2,
                                (uint8_t*)scale + (b * nsr + r) * nsc + cb0);
            } else {
              v512::col_amax_bits(ld, n, colmax.data());
            }
          };
          if (direct_bf16) {
            go(v512::LoadBF16{(const uint16_t*)s.data + row * K + c0});
          } else if (direct_e4m3) {  // the multipliers decode_row would use
            const int64_t srow = (b * s.srows + r / s.sbm) * s.scols, sb0 = c0 / s.sbk, snb = cdiv(n, s.sbk);
            float smult[512 / 16];
            for (int64_t j = 0; j < snb; ++j)
              smult[j] = s.f == Fmt::MXFP8 ? e8m0_to_f32(s.sc_u8[srow + sb0 + j]) : s.sc_f32[srow + sb0 + j];
            go(v512::LoadE4M3{s.data + row * K + c0, smult, s.lut, __builtin_ctzll((unsigned long long)s.sbk)});
          } else {
            decode_row(s, b, r, c0, n, v);
            go(v512::LoadF32{v});
          }
          continue;
        }
#endif
        decode_row(s, b, r, c0, n, v);
        block_amax_row(v, n, bk, amax.data());
        if (bm == 1) {
          for (int64_t j = 0; j < nbc; ++j) mult[j] = block_params(b, r, cb0 + j, amax[j]);
          encode(v, n, mult.data(), row, c0);
        } else {
          uint32_t* m = ramax.data() + ((r - r0) / bm) * nbc;
          for (int64_t j = 0; j < nbc; ++j) m[j] = amax[j] > m[j] ? amax[j] : m[j];
        }
        if (cw) col_amax_bits(v, n, camax.data());
      }
      if (bm == 1 && !cw) continue;
      if (colwise_blocks) {
        for (int64_t j = 0; j < nbc; ++j) {
          uint32_t m = 0;
          for (int64_t i = j * bk; i < std::min(n, (j + 1) * bk); ++i) m = colmax[i] > m ? colmax[i] : m;
          ramax[j] = m;
        }
      }
      // Scales of the multi-row blocks, then pass 2: decode again and encode.
      if (bm > 1) {
        rmult.resize(nbr * nbc);
        for (int64_t i = 0; i < nbr; ++i)
          for (int64_t j = 0; j < nbc; ++j)
            rmult[i * nbc + j] = block_params(b, r0 / bm + i, cb0 + j, ramax[i * nbc + j]);
      }
      if (cw) {  // 32x1 blocks: e8m0 per column of the 32-row tile
        cmult.resize(n);
        uint8_t* cs = cw_scale + (b * cdiv(M, 32) + r0 / 32) * K + c0;
        for (int64_t i = 0; i < n; ++i) {
          const uint8_t e = mx_scale_from_amax(amax_from_bits(camax[i]));
          cs[i] = e;
          cmult[i] = e8m0_rcp(e);
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t row = b * M + r;
#ifdef CKPTQ_HAVE_AVX512
        if (direct_bf16 && df == Fmt::FP8_BLOCK && !p.d_e5m2) {
          v512::e4m3_blocks(v512::LoadBF16{(const uint16_t*)s.data + row * K + c0}, n, bk,
                            rmult.data() + ((r - r0) / bm) * nbc, data + row * data_row + c0);
          continue;
        }
#endif
        decode_row(s, b, r, c0, n, v);
        if (bm > 1) encode(v, n, rmult.data() + ((r - r0) / bm) * nbc, row, c0);
        if (cw) cast_e4m3_cols(v, n, cmult.data(), cw_data + row * K + c0);
      }
    }
  });
}

// ------------------------------------------------------------------------------ ops
// Outputs of >= 16 MiB: advise transparent huge pages (Linux, THP mode "madvise" or "always") on the
// 2 MiB-aligned interior before the kernels first touch it. A fresh output is untouched memory,
// and faulting it in 4 KiB pages costs about as much as the kernel itself on large tensors
// (165 MiB: 61 ms of first-touch fill with 4 KiB pages, 36 ms with huge pages, 13 ms warm, on the
// benchmark VM); 2 MiB pages take 512x fewer faults. Advisory only: bytes are unchanged and any
// error (no THP, memory not from mmap) is ignored.
void advise_huge_pages(const std::vector<at::Tensor>& outs) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  for (const at::Tensor& t : outs) {
    const uintptr_t p = (uintptr_t)t.data_ptr(), n = (uintptr_t)t.nbytes();
    if (n < 8 * kHuge) continue;
    const uintptr_t a = (p + kHuge - 1) & ~(kHuge - 1), e = (p + n) & ~(kHuge - 1);
    if (e > a) (void)madvise((void*)a, e - a, MADV_HUGEPAGE);
  }
#else
  (void)outs;
#endif
}

std::vector<at::Tensor> requantize_cpu(at::TensorList src, c10::string_view src_format, at::IntArrayRef src_block,
                                       c10::string_view dst_format, at::IntArrayRef dst_block,
                                       std::optional<at::ScalarType> fp8_dtype, bool pow2, double eps,
                                       bool columnwise, const std::optional<at::Tensor>& amax,
                                       const std::optional<at::Tensor>& scale, c10::string_view scale_rule) {
  Plan p = make_plan(src, src_format, src_block, dst_format, dst_block, fp8_dtype, pow2, eps, columnwise, amax, scale,
                     scale_rule);
  TORCH_INTERNAL_ASSERT(p.device.is_cpu());
  advise_huge_pages(p.outs);
  const SrcCpu s = make_src(p);
  const int64_t B = p.B;
  // Per-matrix amax (computed, or the caller's amax= kept bit for bit).
  std::vector<float> tamax;
  if (p.needs_tensor_amax()) {
    tamax = tensor_amax(s, B);
  } else if (p.amax_in.defined()) {
    const float* a = p.amax_in.data_ptr<float>();
    tamax.assign(a, a + B);
  }
  switch (p.df) {
    case Fmt::FP8_TENSOR: {
      std::vector<float> sc(B);
      float* scale_inv = p.outs[1].data_ptr<float>();
      const float fp8_max = p.d_e5m2 ? kE5M2Max : kE4M3Max;
      for (int64_t b = 0; b < B; ++b) {
        sc[b] = p.scale_in.defined() ? p.scale_in.data_ptr<float>()[b]
                                     : fp8_scale_from_amax(tamax[b], fp8_max, p.pow2, p.eps);
        scale_inv[b] = 1.0f / sc[b];  // torch.reciprocal(scale)
      }
      run_elementwise(p, s, sc);
      break;
    }
    case Fmt::NVFP4: {
      std::vector<Nvfp4Tensor> nvt(B);
      float* amax_out = p.outs[2].data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        nvt[b] = nvfp4_tensor(tamax[b]);
        amax_out[b] = tamax[b];
      }
      run_blocked(p, s, nvt);
      break;
    }
    case Fmt::FP8_BLOCK:
    case Fmt::MXFP8:
    case Fmt::MXFP4:
      run_blocked(p, s, {});
      break;
    default:
      run_elementwise(p, s, {});
  }
  return p.outs;
}

at::Tensor amax_cpu(at::TensorList src, c10::string_view src_format, at::IntArrayRef src_block) {
  Plan p;
  plan_source(p, src, src_format, src_block);
  TORCH_INTERNAL_ASSERT(p.device.is_cpu());
  const SrcCpu s = make_src(p);
  std::vector<float> a = tensor_amax(s, p.B);
  at::Tensor out = at::empty(p.batch, at::TensorOptions().dtype(at::kFloat));
  std::memcpy(out.data_ptr<float>(), a.data(), a.size() * sizeof(float));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ckptq, CPU, m) {
  m.impl("requantize", &requantize_cpu);
  m.impl("amax", &amax_cpu);
}

}  // namespace ckptq

// A minimal Python module so that `import ckptq._C` loads this library (which runs the static
// TORCH_LIBRARY_IMPL registrars); it exposes nothing itself. Limited API only (abi3).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "ckptq C++ CPU kernels (torch.ops.ckptq)", -1, nullptr};
  return PyModule_Create(&def);
}
