// Per-element and per-block numerics shared by the CPU (requantize_cpu.cpp) and CUDA
// (cuda/*.cu) kernels. Every function here is the C++ transcription of one function of the
// spec, ckptq/numerics.py, in exactly its fp32 operation order (written down in docs/formats.md).
//
// Rules that keep both backends bit-exact with the reference:
//  * every arithmetic operation is one IEEE fp32 operation: build with no fast-math and no FMA
//    contraction (g++ -ffp-contract=off, nvcc --fmad=false), no flush-to-zero;
//  * comparisons are written so that NaN takes the same branch as the torch op it mirrors
//    (clamp keeps NaN, fmin returns the non-NaN operand, amax propagates NaN);
//  * integer bit tricks operate on the fp32 bit pattern (bit casts, no unions).
//
// No torch includes: this header also compiles in a plain nvcc/g++ unit.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CKPTQ_HD __host__ __device__ __forceinline__
#else
#define CKPTQ_HD inline __attribute__((always_inline))
#endif

namespace ckptq {
namespace num {

// ------------------------------------------------------------------------------------ bits
CKPTQ_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

CKPTQ_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// fp32 constants, bit-identical to numerics.py (each is what `1.0f / x` gives in C).
constexpr uint32_t kFltMaxBits = 0x7F7FFFFFu;   // FLT_MAX
constexpr uint32_t kInv448Bits = 0x3B124925u;   // INV_448  = fp32(1/448)
constexpr uint32_t kInv6Bits = 0x3E2AAAABu;     // INV_6    = fp32(1/6)
constexpr uint32_t kInv2688Bits = 0x39C30C31u;  // INV_2688 = fp32(1/2688)
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;  // torch.full((), nan, dtype=float32)
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kNvfp4Numerator = 2688.0f;  // 6 * 448, exact

CKPTQ_HD float flt_max() { return u2f(kFltMaxBits); }
CKPTQ_HD bool is_nan(float x) { return x != x; }
CKPTQ_HD bool is_inf(float x) { return (f2u(x) & 0x7FFFFFFFu) == 0x7F800000u; }

// numerics._canonical_nan: any NaN becomes the canonical quiet NaN 0x7FC00000.
CKPTQ_HD float canonical_nan(float x) { return is_nan(x) ? u2f(kCanonicalNaN) : x; }

// |x| as ordered bits: for x >= 0 (and NaN with the sign cleared) the uint order of the bits is
// the float order, and every NaN compares above +inf, so a uint max is a NaN-propagating amax.
CKPTQ_HD uint32_t abs_bits(float x) { return f2u(x) & 0x7FFFFFFFu; }
// The amax a reduction of abs_bits gives, as the reference returns it (numerics._amax):
// NaN -> canonical NaN.
CKPTQ_HD float amax_from_bits(uint32_t b) { return b > 0x7F800000u ? u2f(kCanonicalNaN) : u2f(b); }

// torch.clamp(x, lo, hi): NaN passes through, -0.0 stays -0.0.
CKPTQ_HD float clamp_keep_nan(float x, float lo, float hi) {
  x = x < lo ? lo : x;
  return x > hi ? hi : x;
}

// C fminf / torch.fmin: a NaN operand yields the other operand.
CKPTQ_HD float fmin_c(float a, float b) {
  if (is_nan(a)) return b;
  if (is_nan(b)) return a;
  return a < b ? a : b;
}

// ---------------------------------------------------------------------------- FP8 casts
// fp32 -> E4M3 byte, round to nearest even, for |x| <= 448 or NaN (the caller clamps first).
// For numbers bit-identical to c10::detail::fp8e4m3fn_from_fp32_value (what torch's
// .to(float8_e4m3fn) uses; -0.0 -> 0x80); every NaN -> 0x7F, as numerics.cast_fp8 canonicalizes
// NaN before that conversion. Written branch-free so loops vectorize.
CKPTQ_HD uint8_t e4m3_from_clamped(float f) {
  const uint32_t fb = f2u(f);
  const uint32_t sign = fb & 0x80000000u;
  const uint32_t a = fb ^ sign;
  // below 2^-6 (smallest normal): round through the fp32 adder, as c10 does
  constexpr uint32_t denorm_mask = 141u << 23;
  const uint32_t sub = f2u(u2f(a) + u2f(denorm_mask)) - denorm_mask;
  // normal: add the rounding bias (RNE) and take the bits
  const uint32_t mant_odd = (a >> 20) & 1u;
  const uint32_t nrm = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + mant_odd) >> 20;
  const uint32_t r = (a < (121u << 23) ? sub : (nrm == 0x7Fu ? 0x7Eu : nrm)) | (sign >> 24);
  return (uint8_t)(a > 0x7F800000u ? 0x7Fu : r);  // NaN
}

// fp32 -> E5M2 byte, RNE, for |x| <= 57344 or NaN. For numbers bit-identical to
// c10::detail::fp8e5m2_from_fp32_value; every NaN -> 0x7F.
CKPTQ_HD uint8_t e5m2_from_clamped(float f) {
  const uint32_t fb = f2u(f);
  const uint32_t sign = fb & 0x80000000u;
  const uint32_t a = fb ^ sign;
  constexpr uint32_t denorm_mask = 134u << 23;
  const uint32_t sub = f2u(u2f(a) + u2f(denorm_mask)) - denorm_mask;
  const uint32_t mant_odd = (a >> 21) & 1u;
  const uint32_t nrm = (a + ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + mant_odd) >> 21;
  const uint32_t r = (a < (113u << 23) ? sub : nrm) | (sign >> 24);
  return (uint8_t)(a > 0x7F800000u ? 0x7Fu : r);
}

// numerics.cast_fp8: NaN -> canonical, clamp to +-max, then RNE.
CKPTQ_HD uint8_t cast_e4m3(float x) { return e4m3_from_clamped(clamp_keep_nan(x, -kE4M3Max, kE4M3Max)); }
CKPTQ_HD uint8_t cast_e5m2(float x) { return e5m2_from_clamped(clamp_keep_nan(x, -kE5M2Max, kE5M2Max)); }
CKPTQ_HD uint8_t cast_fp8(float x, bool e5m2) { return e5m2 ? cast_e5m2(x) : cast_e4m3(x); }

// E4M3 byte -> fp32 (exact), as c10::detail::fp8e4m3fn_to_fp32_value for non-NaN bytes.
// Used where only finite values matter (block scales are never NaN after cast_e4m3 of a
// finite product) and as the CUDA scale decode; the CPU element decode uses a table taken
// from torch itself.
CKPTQ_HD float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
  if ((b & 0x7Fu) == 0x7Fu) return u2f(sign | 0x7FF00000u);  // c10: NaN -> 0x7FF00000 | sign
  if (e == 0) {
    // subnormal: m * 2^-9, exact in fp32
    return u2f(sign | f2u((float)m * u2f(0x3B000000u)));  // 0x3B000000 = 2^-9
  }
  return u2f(sign | ((e + 120u) << 23) | (m << 20));
}

// ----------------------------------------------------------------- FP8 scale from amax
// numerics.fp8_scale_from_amax (TE compute_scale_from_amax), one element:
//   amax = max(amax, eps) [torch.where(amax < eps, eps, amax)]; amax 0/inf/NaN -> 1;
//   else scale = fp8_max / amax; inf -> FLT_MAX; pow2: bits & 0xFF800000.
CKPTQ_HD float fp8_scale_from_amax(float amax, float fp8_max, bool pow2, float eps) {
  amax = amax < eps ? eps : amax;
  const bool special = amax == 0.0f || is_inf(amax) || is_nan(amax);
  float scale = fp8_max / (special ? 1.0f : amax);
  scale = is_inf(scale) ? flt_max() : scale;
  scale = special ? 1.0f : scale;
  if (pow2) scale = u2f(f2u(scale) & 0xFF800000u);
  return scale;
}

// ------------------------------------------------------------------------- E8M0 (MXFP8)
// numerics.e8m0_from_fp32 (TE float_to_e8m0): exponent of v rounded up.
CKPTQ_HD uint8_t e8m0_from_f32(float v) {
  const uint32_t bits = f2u(v);
  const uint32_t exp = (bits >> 23) & 0xFFu;
  const uint32_t man = bits & 0x7FFFFFu;
  const bool bump = man > 0 && exp != 0xFEu && !(exp == 0 && man <= 0x400000u);
  uint32_t e = exp + (bump ? 1u : 0u);
  e = is_inf(v) ? 254u : e;
  e = is_nan(v) ? 255u : e;
  e = v == 0.0f ? 0u : e;
  return (uint8_t)e;
}

// numerics._pow2_from_biased: 2^(biased - 127) as exact fp32 for biased in [-23, 255];
// 255 -> NaN (canonical), below -22 -> 0.
CKPTQ_HD float pow2_from_biased(int32_t biased) {
  if (biased >= 255) return u2f(kCanonicalNaN);
  if (biased < -22) return 0.0f;
  if (biased >= 1) return u2f((uint32_t)(biased > 254 ? 254 : biased) << 23);
  int32_t sh = 22 + biased;  // biased 0 -> 2^-127 = bit 22
  sh = sh < 0 ? 0 : (sh > 22 ? 22 : sh);
  return u2f(1u << sh);
}

// numerics.e8m0_to_fp32: decode multiplier 2^(e - 127); 0 -> 2^-127, 255 -> NaN.
CKPTQ_HD float e8m0_to_f32(uint8_t e) { return pow2_from_biased((int32_t)e); }

// numerics.pow2_from_e8m0_rcp (TE exp2f_rcp): encode multiplier 2^(127 - e); 255 -> NaN.
CKPTQ_HD float e8m0_rcp(uint8_t e) {
  if (e == 255) return u2f(kCanonicalNaN);
  return pow2_from_biased(254 - (int32_t)e);
}

// MXFP8 block: the E8M0 byte from the block amax (v = amax * (1/448), a multiply).
CKPTQ_HD uint8_t mx_scale_from_amax(float amax) { return e8m0_from_f32(amax * u2f(kInv448Bits)); }

// -------------------------------------------------------------------------------- E2M1
// E2M1 magnitude index of a = |v| (0..7 into {0, .5, 1, 1.5, 2, 3, 4, 6}), round half to even,
// saturating at 6. The spec (numerics.e2m1_encode) counts thresholds: (a > .25) + (a >= .75) +
// (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5). This form rounds instead: below 1
// through the fp32 adder at 2^22 (ulp 0.5, RNE), from 1 on to one mantissa bit (RNE on the bits);
// it equals the threshold count for every fp32 a in [0, +inf] (checked exhaustively, all 2^31
// patterns) in about half the instructions. NaN is handled by the callers.
CKPTQ_HD uint32_t e2m1_index(float a) {
  a = a < 6.0f ? a : 6.0f;
  const uint32_t sub = f2u(a + 4194304.0f) - 0x4A800000u;  // (a + 2^22) - 2^22 in 0.5 units
  const uint32_t bits = f2u(a);
  const uint32_t nrm = ((bits + 0x1FFFFFu + ((bits >> 22) & 1u)) >> 22) - 252u;
  return a < 1.0f ? sub : nrm;
}

// numerics.e2m1_encode: code of v (already clamped to +-6): signbit(v) << 3 | index, ties to even;
// NaN -> 0x7 (-0.0 and -0.1 give 0x8).
CKPTQ_HD uint8_t e2m1_encode(float v) {
  const uint32_t code = e2m1_index(u2f(abs_bits(v))) | ((f2u(v) >> 28) & 8u);
  return (uint8_t)(is_nan(v) ? 7u : code);
}

// numerics.e2m1_decode: {0, .5, 1, 1.5, 2, 3, 4, 6} with the sign in bit 3 (exact).
CKPTQ_HD float e2m1_decode(uint32_t code) {
  const uint32_t m = code & 7u;
  uint32_t bits = m < 2u ? (m ? 0x3F000000u : 0u) : ((((m >> 1) + 126u) << 23) | ((m & 1u) << 22));
  return u2f(bits | ((code & 8u) << 28));
}

// --------------------------------------------------------------------- NVFP4 two-level
// numerics.nvfp4_global_encode_scale: S_enc = 2688 / amax; fminf(S_enc, FLT_MAX);
// amax == 0 or S_enc == 0 -> 1.
CKPTQ_HD float nvfp4_s_enc(float amax) {
  float s = kNvfp4Numerator / amax;
  s = fmin_c(s, flt_max());
  return (amax == 0.0f || s == 0.0f) ? 1.0f : s;
}

// Per-tensor constants of one NVFP4 matrix (computed once per batch index).
struct Nvfp4Tensor {
  float s_dec;       // 1 / S_enc
  float s_enc_div6;  // S_enc * (1/6)
};

CKPTQ_HD Nvfp4Tensor nvfp4_tensor(float amax) {
  const float s_enc = nvfp4_s_enc(amax);
  Nvfp4Tensor t;
  t.s_dec = 1.0f / s_enc;
  t.s_enc_div6 = s_enc * u2f(kInv6Bits);
  return t;
}

// Block scale byte: s = e4m3_rne_sat(amax_block * (S_enc * (1/6))).
CKPTQ_HD uint8_t nvfp4_block_scale(float amax_block, const Nvfp4Tensor& t) {
  return cast_e4m3(amax_block * t.s_enc_div6);
}

// Encode multiplier: enc = fminf(1 / (float(s) * S_dec), FLT_MAX).
CKPTQ_HD float nvfp4_enc(float s, const Nvfp4Tensor& t) { return fmin_c(1.0f / (s * t.s_dec), flt_max()); }

// Element code: e2m1_rne(clamp(x * enc, -6, 6)). clamp keeps the sign (and -0.0) and e2m1_index
// saturates at 6, so the clamp folds into the index.
CKPTQ_HD uint8_t nvfp4_code(float x, float enc) { return e2m1_encode(x * enc); }

// Decode multiplier (TE dequantize order, uses amax not S_dec): (float(s) * amax) * (1/2688).
CKPTQ_HD float nvfp4_dec_mult(float s, float amax) { return (s * amax) * u2f(kInv2688Bits); }

// -------------------------------------------------------------------------------- MXFP4
// numerics.MXFP4_SCALE_RULES, in that order (the op's scale_rule string, parsed in requantize.h).
enum class Mxfp4Rule : int32_t { FLOOR = 0, EVEN = 1, CEIL = 2, RCEIL = 3 };

// numerics.mxfp4_scale_from_amax: the E8M0 byte of a block from its fp32 amax (>= 0 or NaN).
//   floor: max(E - 2, 0); even: E of (bits + 2^21) with the mantissa cleared, then max(E' - 2, 0);
//   ceil: max(E + (m != 0) - 2, 0); rceil: e8m0_from_f32(amax / 6) (an fp32 division);
//   every rule: +inf -> 254, NaN -> 255.
// Unsigned arithmetic throughout (bits + 2^21 of a NaN would overflow an int).
CKPTQ_HD uint8_t mxfp4_scale_from_amax(float amax, Mxfp4Rule rule) {
  uint32_t e;
  if (rule == Mxfp4Rule::RCEIL) {
    e = e8m0_from_f32(amax / 6.0f);
  } else {
    uint32_t bits = f2u(amax);
    if (rule == Mxfp4Rule::EVEN) bits = (bits + 0x200000u) & 0x7F800000u;
    uint32_t exp = (bits >> 23) & 0xFFu;
    if (rule == Mxfp4Rule::CEIL) exp += (bits & 0x7FFFFFu) != 0u ? 1u : 0u;
    e = exp < 2u ? 0u : (exp - 2u > 254u ? 254u : exp - 2u);
  }
  e = is_inf(amax) ? 254u : e;
  e = is_nan(amax) ? 255u : e;
  return (uint8_t)e;
}

// The MXFP4 element code, e2m1_rne(clamp(x * 2^(127 - s), -6, 6)) with mult = e8m0_rcp(s), is
// nvfp4_code(x, mult): the same multiply, then e2m1_encode (the clamp folds into e2m1_index).

}  // namespace num

// ------------------------------------------------------------------ format descriptors
// Formats as the op's string arguments name them. The hp formats are plain tensors.
enum class Fmt : int32_t {
  F32 = 0,
  BF16 = 1,
  F16 = 2,
  FP8_TENSOR = 3,
  FP8_BLOCK = 4,
  MXFP8 = 5,
  NVFP4 = 6,
  MXFP4 = 7
};

// Formats whose data packs two E2M1 codes per byte (data is (..., M, K/2)).
CKPTQ_HD bool fmt_is_fp4(Fmt f) { return f == Fmt::NVFP4 || f == Fmt::MXFP4; }

CKPTQ_HD bool fmt_is_hp(Fmt f) { return f == Fmt::F32 || f == Fmt::BF16 || f == Fmt::F16; }

}  // namespace ckptq
