// CUDA kernels of ckptq::requantize / ckptq::amax. No torch includes (compiles standalone).
//
// Design (the same as the CPU backend, on registers instead of an L1 row):
//  * A CTA of 256 threads owns a tile of TR x TC elements of one matrix (one tile per CTA); each
//    thread owns rows_for(S, D) row segments of 16 contiguous elements (rows ty, ty + RP, ...;
//    the same 16 columns). All raw loads of a thread (16-byte, 8-byte for packed FP4, when
//    K % 16 == 0) are issued before any is used; the raw bytes stay in registers.
//  * Each segment is decoded from the source format into 16 fp32 registers (numerics.h: the
//    spec's dequantize arithmetic), block amaxes are reduced with warp shuffles (and shared-memory
//    atomics for blocks that span warps: 128x128, 16x16, the 32x1 columnwise copy), the target's
//    block scales computed, and the registers encoded and stored; where a block spans rows the
//    segment is decoded a second time from its raw registers. No high-precision value ever
//    leaves the chip.
//  * Per-tensor targets (fp8_tensor; nvfp4 without amax=) first run amax_kernel, a max-reduction
//    pass over the source (for FP8 / NVFP4 sources on the raw codes, see seg_amax_raw); the
//    encode pass then walks the tiles in reverse order so that its first tiles are the ones the
//    amax pass read last (possibly still in L2).
//  * nvfp4 targets: E2M1 rounding by one fp32 add of a magic number
//    (e2m1_magic_bits), the encode multiplier from a per-CTA table of the 256 scale bytes; and for
//    bf16 / fp16 sources with 1x16 blocks and K % 16 == 0 a separate streaming kernel
//    (nv1d_kernel: persistent CTAs, tiles brought into shared memory by bulk asynchronous copies
//    several tiles ahead). CKPTQ_NVFP4_ENCODE=baseline still runs the encode of before (D_NVB).
//  * mxfp4 (S_MX4 / D_MX4): packed E2M1 like nvfp4 (8 bytes per 16-element segment, the same decode
//    and the same E2M1 packing, nvfp4_pack8), one E8M0 byte per 1x32 block (two segments) from the
//    scale rule of numerics.h mxfp4_scale_from_amax; the encode multiplier is e8m0_rcp of that byte.
// Numerics: numerics.h shared with the CPU; FP8 casts use the sm_89+ cvt.rn.satfinite
// instructions (bit-identical to the spec's NaN-canonicalizing, clamping RNE cast: NaN -> 0x7F),
// bf16/fp16 the same conversions c10 uses on the device. Build with --fmad=false.
// tests/test_kernels_cuda.py checks every pair bit for bit against the reference on the GPU,
// including every fp32 bit pattern through each cast.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../numerics.h"

namespace ckptq {
namespace cudak {

using namespace ckptq::num;

// MX4: mxfp4 (packed E2M1 like S_NV, E8M0 scales like S_MX).
enum SrcKind : int { S_F32 = 0, S_BF16, S_F16, S_FP8, S_MX, S_NV, S_MX4 };
// MXCW: mxfp8 + columnwise copy. NVB: nvfp4 with the earlier encode (per-block division,
// threshold-style E2M1 rounding), kept as the benchmark baseline (CKPTQ_NVFP4_ENCODE=baseline).
// MX4: mxfp4 (1x32 blocks).
enum DstKind : int { D_F32 = 0, D_BF16, D_F16, D_FP8T, D_FP8B, D_MX, D_NV, D_MXCW, D_NVB, D_MX4 };
__host__ __device__ constexpr bool is_nv(int D) { return D == D_NV || D == D_NVB; }
// Targets whose data packs two E2M1 codes per byte.
__host__ __device__ constexpr bool is_fp4_dst(int D) { return is_nv(D) || D == D_MX4; }
// Sources whose data packs two E2M1 codes per byte (16 elements = 8 bytes per segment).
__host__ __device__ constexpr bool is_fp4_src(int S) { return S == S_NV || S == S_MX4; }

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xFFFFFFFFu;

// Row segments (of 16 elements) per thread and tile: each thread issues all its loads before it
// uses any (rows x 32 B in flight for 16-bit sources), with few enough registers for 2 CTAs per SM
// (3 for the two-pass 128x128 fp8_block kernel, which then holds 4 rows). The amax kernel uses
// the target-independent rows_for(S, -1). Tile rows = rows x 256 / segments per tile row.
// CKPTQ_OCC_POLICY (a build-time tuning knob, CKPTQ_NVCC_FLAGS=-DCKPTQ_OCC_POLICY=n): 0 = 2 CTAs/SM and
// 8 rows everywhere; 1 = 3 CTAs/SM and 4 rows for 16-bit sources into fp8_block; 2 (default, fastest
// on H200) = also for fp8/mx sources and nvfp4 targets.
#ifndef CKPTQ_OCC_POLICY
#define CKPTQ_OCC_POLICY 2
#endif
__host__ __device__ constexpr bool three_per_sm(int S, int D) {
  return CKPTQ_OCC_POLICY == 0 ? false
         : CKPTQ_OCC_POLICY == 1 ? (D == D_FP8B && (S == S_BF16 || S == S_F16))
                                 : ((D == D_FP8B || is_nv(D)) && (S == S_BF16 || S == S_F16 || S == S_FP8 || S == S_MX));
}
__host__ __device__ constexpr int rows_for(int S, int D) { return (S == S_F32 || three_per_sm(S, D)) ? 4 : 8; }
__host__ __device__ constexpr int min_blocks_for(int S, int D) { return three_per_sm(S, D) ? 3 : 2; }
// Preferred segments per tile row: about 256 contiguous source bytes per row and tile.
__host__ __device__ constexpr int seg_cols_for(int S) {
  return S == S_F32 ? 4 : ((S == S_BF16 || S == S_F16) ? 8 : (is_fp4_src(S) ? 32 : 16));
}
// 32-bit words of raw source bytes per segment.
__host__ __device__ constexpr int words_for(int S) {
  return S == S_F32 ? 16 : ((S == S_BF16 || S == S_F16) ? 8 : (is_fp4_src(S) ? 2 : 4));
}

struct Params {
  int64_t B;
  int32_t M, K;
  // source
  const void* s_data;
  const void* s_scale;  // fp8: fp32 scale_inv grid; mx, mx4: e8m0 bytes; nv: e4m3 bytes
  const float* s_amax;  // nv
  int32_t s_lbm, s_lbk, s_srows, s_scols;  // log2 of the source block (per tensor: 31, 31)
  int32_t s_e5m2;
  // target
  void* d_data;
  void* d_scale;
  void* d_cw_data;
  uint8_t* d_cw_scale;
  int32_t lbm, lbk;  // log2 of the target block
  int32_t nsr, nsc;  // target rowwise scale grid per matrix
  int32_t d_e5m2, pow2, columnwise;
  int32_t mx_rule;  // mxfp4 target: num::Mxfp4Rule
  float eps;
  const float* t_amax;   // per matrix: nvfp4 / fp8_tensor amax (computed or given)
  const float* t_scale;  // per matrix: fp8_tensor explicit scale, or null
  float* t_scale_inv;    // fp8_tensor scale_inv output
  // tiling
  int32_t lsc;  // log2 of the 16-element segments per tile row
  int32_t ntr, ntc;
  int32_t vec;  // 16-byte accesses are aligned (K % 16 == 0, aligned pointers)
  int32_t reverse;
};

// ------------------------------------------------------------------------ conversions
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t pair, bool e5m2) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)pair, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

__device__ __forceinline__ float fp8_to_float(uint8_t b, bool e5m2) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(*reinterpret_cast<const __half*>(&h));
}

// Two fp32 -> two FP8 bytes (lo = a), RNE, saturating: the spec's cast_fp8 (clamp, then round).
__device__ __forceinline__ uint32_t cvt_fp8x2(float a, float b, bool e5m2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  if (e5m2)
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(r) : "f"(a), "f"(b));
  else
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(a), "f"(b));
  return r;
#else
  return (uint32_t)cast_fp8(a, e5m2) | ((uint32_t)cast_fp8(b, e5m2) << 8);
#endif
}

__device__ __forceinline__ uint16_t bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16(x)); }
__device__ __forceinline__ uint16_t f16_bits(float x) { return __half_as_ushort(__float2half(x)); }

// Two fp32 -> packed bf16x2 / f16x2 (lo = a): cvt.rn.{bf16x2,f16x2}.f32, the same rounding and NaN
// as the one-value conversions c10 uses (the exhaustive sweeps in the tests check every pattern).
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t f16x2_bits(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// fp32 max that propagates NaN (PTX max.NaN, sm_80+), of |v|: the amax reduction step.
__device__ __forceinline__ float amax_step(float m, float v) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
  return r;
}

// E2M1 code c -> float(c) * 2^-126 exactly (0.5 lands on the fp32 subnormal 2^-127): the sign and
// magnitude bits shifted into an fp32. Multiplying by 2^126 gives e2m1(c) exactly, so
// x = e2m1(c) * m equals e2m1_scaled(c) * (m * 2^126) whenever that product is exact.
__device__ __forceinline__ float e2m1_scaled(uint32_t c) {
  return __uint_as_float(((c & 7u) << 22) | ((c & 8u) << 28));
}
constexpr uint32_t kPow2_126 = 0x7E800000u;

// GPU E2M1 code of x * enc: the spec's e2m1_encode(clamp(x * enc, -6, 6)) without its NaN select:
// a product on the GPU is either a number or the positive canonical NaN, which the index already
// maps to 7 (min(NaN, 6) = 6) with a clear sign bit.
__device__ __forceinline__ uint32_t nvfp4_code_gpu(float x, float enc) {
  const float v = x * enc;
  return e2m1_index(fabsf(v)) | ((__float_as_uint(v) >> 28) & 8u);
}

// ------------------------------------------------------- NVFP4 encode without integer-ALU work
// sm_90 has no E2M1 conversion, and the threshold count / bit rounding of e2m1_index costs
// about 11 integer-pipe instructions per element. Here an element costs one fp32
// multiply and one fp32 add (FMA pipe), two min/max, two integer multiplies (FMA pipe) and two
// funnel shifts.
//
// E2M1 rounding by one fp32 add. The E2M1 magnitudes are a fixed-point grid per range of
// a = min(|v|, 6): step 0.5 on [0, 2] (0, .5, 1, 1.5, 2), step 1 on [2, 4] (2, 3, 4), step 2 on
// [4, 6] (4, 6); the spec's ties-to-even thresholds (.25 -> 0, .75 -> 1, 1.25 -> 1, 1.75 -> 2,
// 2.5 -> 2, 3.5 -> 4, 5 -> 4) are exactly round-half-even on that grid. Adding a magic M whose ulp
// is the step rounds a onto the grid in one IEEE add (round to nearest even): with E' = the fp32
// exponent field of max(a, 1) (127, 128 or 129), M = 2^(E' - 127 + 22) has ulp 2^(E' - 128) = the
// step, and bits(a + M) - bits(M) = k = round_half_even(a / step). The E2M1 index is k + 2 (E' - 127)
// (0..4, 4..6, 6..7), so M also carries that offset in its low mantissa bits:
//   bits(M) = (E' + 22) << 23 | 2 (E' - 127) = E' * (2^23 + 2) + (22 << 23) - 254,
// and the low 4 bits of bits(a + M) are the index (bit 3 clear, at most 7). Exact because: the
// offset is even (so the tie-break of the sum's last bit is the tie-break of k), a + M stays in the
// binade of M (a <= 6 is far below 2^(E' + 22)), and a + M is one correctly rounded fp32 add (no
// contraction: --fmad=false). E' comes from an integer multiply-high (mul.hi by 2^9 = shift by 23,
// kept on the FMA pipe). A NaN product (the GPU's positive canonical NaN) gives a = fminf(NaN, 6)
// = 6 -> index 7, sign 0, as the spec's NaN -> 7. Checked against e2m1_encode for every fp32 value.
constexpr uint32_t kE2m1MagicBias = (22u << 23) - 254u;

// mul.hi.u32 through inline PTX so that the multiply is not strength-reduced to a shift (ALU).
__device__ __forceinline__ uint32_t mulhi_u32(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// bits of a + M: the low 4 bits are the E2M1 magnitude index of the product v (see above).
__device__ __forceinline__ uint32_t e2m1_magic_bits(float v) {
  const float a = fminf(fabsf(v), 6.0f);
  const uint32_t e = mulhi_u32(__float_as_uint(fmaxf(a, 1.0f)), 512u);
  return __float_as_uint(a + __uint_as_float(e * 0x800002u + kE2m1MagicBias));
}

// Eight products v = x * enc -> eight E2M1 codes, element j in nibble j. The indices are packed by
// funnel shifts that insert the low nibble of bits(a + M) at the top (element 0 ends lowest); the
// signs by funnel shifts that insert the top nibble of bits(v) (sign in its bit 3) at the bottom,
// masked to bit 3 of each nibble once per word. The sign of v is the spec's signbit (-0.0 -> 8);
// a NaN product is positive on the GPU (code 7).
__device__ __forceinline__ uint32_t nvfp4_pack8(const float* v) {
  uint32_t idx = 0, sgn = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) idx = __funnelshift_r(idx, e2m1_magic_bits(v[j]), 4);
#pragma unroll
  for (int j = 7; j >= 0; --j) sgn = __funnelshift_l(__float_as_uint(v[j]), sgn, 4);
  return idx | (sgn & 0x88888888u);
}

// Block amax bits (abs_bits order) of a 16-bit source segment from its raw words: |x| bits of
// bf16 / fp16 sort like the values (NaN above inf), so a per-halfword unsigned max of the
// sign-cleared words is the NaN-propagating amax; one fp32 conversion at the end (exact).
template <int S>
__device__ __forceinline__ uint32_t seg_amax_16bit(const uint32_t* w) {
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) m = __vmaxu2(m, w[k] & 0x7FFF7FFFu);
  m = max(m & 0xFFFFu, m >> 16);
  if constexpr (S == S_BF16) return m << 16;
  return abs_bits(__half2float(__ushort_as_half((unsigned short)m)));
}

__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint2 ldg8(const void* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }

// ----------------------------------------------------------------------------- decode
// A thread first loads the raw bytes (and the block multiplier) of all its segments, so that every
// load is in flight before any is used, then decodes them from registers -- twice where a target
// block spans rows (amax pass, then encode pass), which costs ALU, not memory.
template <int S>
struct Seg {
  uint32_t w[words_for(S)];
  uint32_t s;  // raw source scale: fp8 scale_inv bits, mx / mx4 e8m0 byte, nv e4m3 byte (decoded later)
  bool ok;     // row < M and column < K
};

// Loads are unconditional (an out-of-range segment reads row 0, column 0 of its matrix and is
// zeroed when decoded), so every load of a thread is issued before the first result is needed.
template <int S>
__device__ __forceinline__ void load_raw(const Params& p, int64_t b, int r, int c, bool ok, Seg<S>& g) {
  g.ok = ok;
  r = ok ? r : 0;
  c = ok ? c : 0;
  const int64_t grow = b * p.M + r;
  const bool full = p.vec != 0;  // vec implies K % 16 == 0, so every in-range segment is full
  const int64_t e0 = grow * (int64_t)p.K + c;
  if constexpr (S == S_FP8) {
    g.s = __float_as_uint(__ldg(reinterpret_cast<const float*>(p.s_scale) +
                                (b * p.s_srows + (r >> p.s_lbm)) * (int64_t)p.s_scols + (c >> p.s_lbk)));
  } else if constexpr (S == S_MX || S == S_MX4) {
    g.s = __ldg(reinterpret_cast<const uint8_t*>(p.s_scale) + grow * p.s_scols + (c >> 5));
  } else if constexpr (S == S_NV) {
    g.s = __ldg(reinterpret_cast<const uint8_t*>(p.s_scale) + (b * p.s_srows + (r >> p.s_lbm)) * (int64_t)p.s_scols +
                (c >> 4));
  } else {
    g.s = 0;
  }
  if (full) {
    if constexpr (S == S_F32) {
      const float* x = reinterpret_cast<const float*>(p.s_data) + e0;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint4 a = ldg16(x + 4 * q);
        g.w[4 * q] = a.x, g.w[4 * q + 1] = a.y, g.w[4 * q + 2] = a.z, g.w[4 * q + 3] = a.w;
      }
    } else if constexpr (S == S_BF16 || S == S_F16) {
      const uint16_t* x = reinterpret_cast<const uint16_t*>(p.s_data) + e0;
      const uint4 a = ldg16(x), q = ldg16(x + 8);
      g.w[0] = a.x, g.w[1] = a.y, g.w[2] = a.z, g.w[3] = a.w, g.w[4] = q.x, g.w[5] = q.y, g.w[6] = q.z, g.w[7] = q.w;
    } else if constexpr (S == S_FP8 || S == S_MX) {
      const uint4 a = ldg16(reinterpret_cast<const uint8_t*>(p.s_data) + e0);
      g.w[0] = a.x, g.w[1] = a.y, g.w[2] = a.z, g.w[3] = a.w;
    } else {  // S_NV, S_MX4: 16 codes in 8 bytes, element 2i in the low nibble
      const uint2 a = ldg8(reinterpret_cast<const uint8_t*>(p.s_data) + (e0 >> 1));
      g.w[0] = a.x, g.w[1] = a.y;
    }
    return;
  }
  // Element-wise path (K % 16 != 0 or unaligned pointers): guarded loads, zeros past K.
#pragma unroll
  for (int k = 0; k < words_for(S); ++k) g.w[k] = 0u;
  if (!ok) return;
  if constexpr (S == S_F32) {
    const float* x = reinterpret_cast<const float*>(p.s_data) + e0;
#pragma unroll
    for (int j = 0; j < 16; ++j) g.w[j] = (c + j < p.K) ? __float_as_uint(__ldg(x + j)) : 0u;
  } else if constexpr (S == S_BF16 || S == S_F16) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(p.s_data) + e0;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (c + j < p.K) g.w[j >> 1] |= (uint32_t)__ldg(x + j) << (16 * (j & 1));
  } else if constexpr (S == S_FP8 || S == S_MX) {
    const uint8_t* x = reinterpret_cast<const uint8_t*>(p.s_data) + e0;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (c + j < p.K) g.w[j >> 2] |= (uint32_t)__ldg(x + j) << (8 * (j & 3));
  } else {
    const uint8_t* x = reinterpret_cast<const uint8_t*>(p.s_data) + (e0 >> 1);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (c + 2 * k < p.K) g.w[k >> 2] |= (uint32_t)__ldg(x + k) << (8 * (k & 3));
  }
}

// The segment's source multiplier (fp8: scale_inv; mx, mx4: 2^(e - 127); nv: (float(s) * amax) / 2688).
template <int S>
__device__ __forceinline__ float seg_mult(const Seg<S>& g, float src_amax) {
  if constexpr (S == S_FP8) return __uint_as_float(g.s);
  if constexpr (S == S_MX || S == S_MX4) return e8m0_to_f32((uint8_t)g.s);
  if constexpr (S == S_NV) return nvfp4_dec_mult(fp8_to_float((uint8_t)g.s, false), src_amax);
  return 0.0f;
}

// The spec's dequantize value of each element (fp32). Elements at or past K, and whole segments of
// rows past M, are 0: they neither raise an amax nor get stored. Exact conversions; NaNs are
// canonicalized where the spec does (casts, amaxes, fp32 outputs).
template <int S>
__device__ __forceinline__ void decode(const Params& p, const Seg<S>& g, int c, float src_amax, float (&v)[16]) {
  const float m = seg_mult<S>(g, src_amax);
  if constexpr (S == S_F32) {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = __uint_as_float(g.w[j]);
  } else if constexpr (S == S_BF16) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[2 * k] = __uint_as_float(g.w[k] << 16);
      v[2 * k + 1] = __uint_as_float(g.w[k] & 0xFFFF0000u);
    }
  } else if constexpr (S == S_F16) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[2 * k] = __half2float(__ushort_as_half((unsigned short)(g.w[k] & 0xFFFFu)));
      v[2 * k + 1] = __half2float(__ushort_as_half((unsigned short)(g.w[k] >> 16)));
    }
  } else if constexpr (S == S_FP8 || S == S_MX) {  // x = float(data) * multiplier
    const bool e5m2 = S == S_FP8 && p.s_e5m2;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f0 = fp8x2_to_float2(g.w[k] & 0xFFFFu, e5m2);
      const float2 f1 = fp8x2_to_float2(g.w[k] >> 16, e5m2);
      v[4 * k] = f0.x * m;
      v[4 * k + 1] = f0.y * m;
      v[4 * k + 2] = f1.x * m;
      v[4 * k + 3] = f1.y * m;
    }
  } else {  // S_NV: x = e2m1(code) * ((float(s) * amax) * (1/2688)); S_MX4: x = e2m1(code) * 2^(e - 127)
    const float p2 = __uint_as_float(kPow2_126);
    const float m1 = m * p2;  // exact unless it overflows (multiplier >= 2)
    if (!(is_inf(m1) && !is_inf(m))) {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = e2m1_scaled(g.w[j >> 3] >> (4 * (j & 7))) * m1;
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = (e2m1_scaled(g.w[j >> 3] >> (4 * (j & 7))) * p2) * m;
    }
  }
  if (!g.ok) {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = 0.0f;
  } else if (!p.vec) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (c + j >= p.K) v[j] = 0.0f;
  }
}

// Block amax of a segment as ordered bits (NaN above +inf), see numerics.h abs_bits.
__device__ __forceinline__ uint32_t seg_amax(const float (&v)[16]) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) m = amax_step(m, v[j]);
  return __float_as_uint(m);
}

// ------------------------------------------------------------------------------ stores
__device__ __forceinline__ void store_fp8_seg(const Params& p, uint8_t* out, const float (&v)[16], float mult,
                                              bool e5m2, int c) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = cvt_fp8x2(v[4 * k] * mult, v[4 * k + 1] * mult, e5m2) |
           (cvt_fp8x2(v[4 * k + 2] * mult, v[4 * k + 3] * mult, e5m2) << 16);
  if (p.vec) {
    *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (c + j < p.K) out[j] = (uint8_t)(w[j >> 2] >> (8 * (j & 3)));
  }
}

template <int D>
__device__ __forceinline__ void store_hp_seg(const Params& p, int64_t o, float (&v)[16], int c) {
  if constexpr (D == D_F32) {
    float* out = reinterpret_cast<float*>(p.d_data) + o;
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = canonical_nan(v[j]);
    if (p.vec) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        reinterpret_cast<float4*>(out)[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (c + j < p.K) out[j] = v[j];
    }
  } else {  // bf16 / fp16: cvt.rn.{bf16,f16}.f32 write the canonical NaN for any NaN
    uint16_t* out = reinterpret_cast<uint16_t*>(p.d_data) + o;
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = D == D_BF16 ? bf16x2_bits(v[2 * k], v[2 * k + 1]) : f16x2_bits(v[2 * k], v[2 * k + 1]);
    if (p.vec) {
      reinterpret_cast<uint4*>(out)[0] = make_uint4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<uint4*>(out)[1] = make_uint4(w[4], w[5], w[6], w[7]);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (c + j < p.K) out[j] = (uint16_t)(w[j >> 1] >> (16 * (j & 1)));
    }
  }
}

template <int D>
__device__ __forceinline__ void store_nvfp4_seg(const Params& p, uint8_t* out, const float (&v)[16], float enc, int c) {
  uint32_t w[2] = {0, 0};
  if constexpr (D == D_NVB) {
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j >> 3] |= nvfp4_code_gpu(v[j], enc) << (4 * (j & 7));
  } else {
    float x[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) x[j] = v[j] * enc;  // the spec's x * enc, one fp32 multiply
    w[0] = nvfp4_pack8(x);
    w[1] = nvfp4_pack8(x + 8);
  }
  if (p.vec) {
    *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (c + 2 * k < p.K) out[k] = (uint8_t)(w[k >> 2] >> (8 * (k & 3)));
  }
}

// Tile coordinates of this CTA: matrix b, first row r0, this thread's column c (see Params).
struct Tile {
  int64_t b, rem;
  int r0, c, tx, ty, RP, SC;
};

__device__ __forceinline__ int64_t num_tiles(const Params& p) { return p.B * (int64_t)p.ntr * p.ntc; }

// Tile number n (0 <= n < num_tiles): reversed when p.reverse (see the file comment).
template <int R>
__device__ __forceinline__ Tile tile_of(const Params& p, int64_t n) {
  Tile t;
  const int tid = threadIdx.x;
  t.SC = 1 << p.lsc;
  t.tx = tid & (t.SC - 1);
  t.ty = tid >> p.lsc;
  t.RP = kThreads >> p.lsc;
  const int64_t idx = p.reverse ? num_tiles(p) - 1 - n : n;
  const int64_t per_mat = (int64_t)p.ntr * p.ntc;
  t.b = idx / per_mat;
  t.rem = idx - t.b * per_mat;
  const int tr = (int)(t.rem / p.ntc), tc = (int)(t.rem - (int64_t)tr * p.ntc);
  t.r0 = tr * t.RP * R;
  t.c = tc * t.SC * 16 + t.tx * 16;
  return t;
}

// Issue the loads of all R segments of this thread (rows r0 + ty + i * RP).
template <int S, int R>
__device__ __forceinline__ void load_tile(const Params& p, const Tile& t, Seg<S> (&g)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = t.r0 + t.ty + i * t.RP;
    load_raw<S>(p, t.b, r, t.c, r < p.M && t.c < p.K, g[i]);
  }
}

// ------------------------------------------------------------------------ amax kernel
// Per-matrix amax of the decoded source into out[b] (uint32 view of fp32, zero-initialized):
// NaN-propagating uint max of |x| bits, NaN canonicalized before the atomic. Same tiles as the
// requantize kernel, walked forward.
// Segment amax of an FP8 / NVFP4 source without decoding every element: |x| = |float(d)| * |m|
// exactly and rounding is monotonic, so max |x| = float(max |d|) * |m|; the magnitude bits of the
// codes sort like their values (NaN codes above every number), so a bytewise / nibblewise integer
// max finds max |d|. Multipliers that are not finite take the element-wise path (0 * inf = NaN).
template <int S>
__device__ __forceinline__ uint32_t seg_amax_raw(const Params& p, const Seg<S>& g, int c, float src_amax) {
  if (!g.ok) return 0u;
  const float m = seg_mult<S>(g, src_amax);
  if constexpr (S == S_FP8 || S == S_MX) {
    if (!p.vec || is_inf(m) || is_nan(m)) {
      float v[16];
      decode<S>(p, g, c, src_amax, v);
      return seg_amax(v);
    }
    uint32_t mx = __vmaxu4(__vmaxu4(g.w[0] & 0x7F7F7F7Fu, g.w[1] & 0x7F7F7F7Fu),
                           __vmaxu4(g.w[2] & 0x7F7F7F7Fu, g.w[3] & 0x7F7F7F7Fu));
    mx = __vmaxu4(mx, mx >> 16);
    mx = __vmaxu4(mx, mx >> 8) & 0x7Fu;
    return abs_bits(fp8_to_float((uint8_t)mx, S == S_FP8 && p.s_e5m2) * m);
  } else if constexpr (is_fp4_src(S)) {
    if (!p.vec || is_inf(m) || is_nan(m)) {
      float v[16];
      decode<S>(p, g, c, src_amax, v);
      return seg_amax(v);
    }
    // nibblewise max of the 3-bit magnitudes: x | 8 - y keeps each nibble's borrow-free bit 3
    auto nmax = [](uint32_t x, uint32_t y) {
      const uint32_t ge = (((x | 0x88888888u) - y) & 0x88888888u) >> 3;  // 1 where x >= y
      const uint32_t sel = ge * 0xFu;
      return (x & sel) | (y & ~sel);
    };
    uint32_t mx = nmax(g.w[0] & 0x77777777u, g.w[1] & 0x77777777u);
    mx = nmax(mx, mx >> 16);
    mx = nmax(mx, mx >> 8);
    mx = nmax(mx, mx >> 4) & 0x7u;
    return abs_bits(e2m1_decode(mx) * m);
  } else {
    float v[16];
    decode<S>(p, g, c, src_amax, v);
    return seg_amax(v);
  }
}

template <int S>
__global__ void __launch_bounds__(kThreads, 2) amax_kernel(const Params p, uint32_t* __restrict__ out) {
  constexpr int R = rows_for(S, -1);
  const Tile t = tile_of<R>(p, blockIdx.x);
  Seg<S> g[R];
  load_tile<S, R>(p, t, g);
  const float src_amax = S == S_NV ? __ldg(p.s_amax + t.b) : 0.0f;
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < R; ++i) m = max(m, seg_amax_raw<S>(p, g[i], t.c, src_amax));
  m = __reduce_max_sync(kFull, m);
  __shared__ uint32_t red[kThreads / 32];
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t x = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) x = max(x, red[w]);
    x = x > 0x7F800000u ? kCanonicalNaN : x;
    if (x) atomicMax(out + t.b, x);
  }
}

// -------------------------------------------------------------------- requantize kernel
// Decode, reduce and encode one tile whose raw bytes are in g (loads issued earlier).
template <int S, int D, int R>
__device__ __forceinline__ void process_tile(const Params& p, const Tile& t, const Seg<S> (&g)[R], uint32_t* s_blk,
                                             uint32_t* s_col, const float* s_enc) {
  const int tid = threadIdx.x;
  const int SC = t.SC, tx = t.tx, ty = t.ty, RP = t.RP, TC = SC * 16;
  const int64_t b = t.b;
  const int r0 = t.r0, c = t.c;
  const float src_amax = S == S_NV ? __ldg(p.s_amax + b) : 0.0f;

  // ---- high-precision targets: fp32 math done (NaN canonical), cast at the end
  if constexpr (D == D_F32 || D == D_BF16 || D == D_F16) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!g[i].ok) continue;
      float v[16];
      decode<S>(p, g[i], c, src_amax, v);
      store_hp_seg<D>(p, (b * p.M + r0 + ty + i * RP) * (int64_t)p.K + c, v, c);
    }
  }

  // ---- fp8_tensor: one scale per matrix (explicit, or from the matrix amax)
  if constexpr (D == D_FP8T) {
    const bool e5m2 = p.d_e5m2 != 0;
    const float scale = p.t_scale ? p.t_scale[b]
                                  : fp8_scale_from_amax(p.t_amax[b], e5m2 ? kE5M2Max : kE4M3Max, p.pow2 != 0, p.eps);
    if (t.rem == 0 && tid == 0) p.t_scale_inv[b] = 1.0f / scale;  // torch.reciprocal(scale)
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!g[i].ok) continue;
      float v[16];
      decode<S>(p, g[i], c, src_amax, v);
      store_fp8_seg(p, reinterpret_cast<uint8_t*>(p.d_data) + (b * p.M + r0 + ty + i * RP) * (int64_t)p.K + c, v,
                    scale, e5m2, c);
    }
  }

  // ---- blocked targets: block amax over (bm x bk) = (2^lbm rows) x (G = 2^lg segments)
  if constexpr (D == D_FP8B || D == D_MX || D == D_MXCW || is_fp4_dst(D)) {
    const int lg = p.lbk - 4;
    const int G = 1 << lg;
    const int lwr = 5 - p.lsc;  // log2 of the rows one warp covers per pass
    uint8_t* data = reinterpret_cast<uint8_t*>(p.d_data);
    const bool scale_writer_col = (tx & (G - 1)) == 0;
    const bool e5m2 = D == D_FP8B && p.d_e5m2 != 0;
    const float fmax = e5m2 ? kE5M2Max : kE4M3Max;
    Nvfp4Tensor T{};
    if constexpr (is_nv(D)) T = nvfp4_tensor(p.t_amax[b]);
    // nvfp4 from bf16 / fp16: block amaxes from the raw words (2 elements per integer max). Raw
    // words past K are zero (load_raw); segments past M are skipped (1x16) or zeroed (16x16).
    // Not for blocks of two segments (mxfp4, 1x32): a segment at c >= K holds raw words of row 0
    // (ok false) that would join its block's amax; seg_amax of the decoded (zeroed) values is used.
    constexpr bool fast_amax = D == D_NV && (S == S_BF16 || S == S_F16);

    // Block amax -> (encode multiplier; writes the block scale if this thread owns it).
    auto params = [&](uint32_t abits, int r, bool writer) -> float {
      const float amax = amax_from_bits(abits);
      if constexpr (D == D_FP8B) {
        const float sc = fp8_scale_from_amax(amax, fmax, p.pow2 != 0, p.eps);
        if (writer)
          reinterpret_cast<float*>(p.d_scale)[(b * p.nsr + (r >> p.lbm)) * (int64_t)p.nsc + (c >> p.lbk)] = 1.0f / sc;
        return sc;
      } else if constexpr (is_nv(D)) {  // s = e4m3(amax * (S_enc / 6)); enc = fminf(1 / (s * S_dec), FLT_MAX)
        const uint8_t sb = (uint8_t)(cvt_fp8x2(amax * T.s_enc_div6, 0.0f, false) & 0xFFu);
        if (writer) reinterpret_cast<uint8_t*>(p.d_scale)[(b * p.nsr + (r >> p.lbm)) * (int64_t)p.nsc + (c >> 4)] = sb;
        if constexpr (D == D_NV) return s_enc[sb];  // the same function of the byte, tabulated per CTA
        return nvfp4_enc(fp8_to_float(sb, false), T);
      } else if constexpr (D == D_MX4) {  // e = the scale rule's E8M0 byte; multiplier 2^(127 - e)
        const uint8_t e = mxfp4_scale_from_amax(amax, (Mxfp4Rule)p.mx_rule);
        if (writer) reinterpret_cast<uint8_t*>(p.d_scale)[(b * p.M + r) * (int64_t)p.nsc + (c >> 5)] = e;
        return e8m0_rcp(e);
      } else {
        const uint8_t e = mx_scale_from_amax(amax);
        if (writer) reinterpret_cast<uint8_t*>(p.d_scale)[(b * p.M + r) * (int64_t)p.nsc + (c >> 5)] = e;
        return e8m0_rcp(e);
      }
    };
    auto encode = [&](const float (&v)[16], float mult, int r) {
      uint8_t* out = data + (((b * p.M + r) * (int64_t)p.K + c) >> (is_fp4_dst(D) ? 1 : 0));
      if constexpr (D == D_MX4)  // codes of v * mult (nvfp4_code), packed as nvfp4's
        store_nvfp4_seg<D_NV>(p, out, v, mult, c);
      else if constexpr (is_nv(D))
        store_nvfp4_seg<D>(p, out, v, mult, c);
      else
        store_fp8_seg(p, out, v, mult, e5m2, c);
    };

    if constexpr (D == D_MXCW) {
      for (int k = tid; k < R * 128; k += kThreads) s_col[k] = 0;
      __syncthreads();
    }
    if (p.lbm == 0) {  // blocks within one row: decode, reduce over G lanes, encode
#pragma unroll
      for (int i = 0; i < R; ++i) {
        float v[16];
        decode<S>(p, g[i], c, src_amax, v);
        uint32_t a = fast_amax ? seg_amax_16bit<S>(g[i].w) : seg_amax(v);
        for (int off = 1; off < G; off <<= 1) a = max(a, __shfl_xor_sync(kFull, a, off));
        if constexpr (D == D_MXCW) {  // 32x1 blocks: per column amax over 32 rows
          const int lr5 = min(5, lwr);
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            uint32_t x = abs_bits(v[j]);
            for (int off = SC; off < (SC << lr5); off <<= 1) x = max(x, __shfl_xor_sync(kFull, x, off));
            if ((ty & ((1 << lr5) - 1)) == 0) atomicMax(&s_col[((ty + i * RP) >> 5) * TC + tx * 16 + j], x);
          }
        }
        if (!g[i].ok) continue;
        const int r = r0 + ty + i * RP;
        encode(v, params(a, r, scale_writer_col), r);
      }
    } else {  // blocks span rows: amax pass, reduction across lanes and warps, encode pass
      uint32_t a[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        float v[16];
        decode<S>(p, g[i], c, src_amax, v);
        a[i] = fast_amax ? (g[i].ok ? seg_amax_16bit<S>(g[i].w) : 0u) : seg_amax(v);
      }
      for (int off = 1; off < G; off <<= 1) {
#pragma unroll
        for (int i = 0; i < R; ++i) a[i] = max(a[i], __shfl_xor_sync(kFull, a[i], off));
      }
      const int lr = min(p.lbm, lwr);
      for (int off = SC; off < (SC << lr); off <<= 1) {
#pragma unroll
        for (int i = 0; i < R; ++i) a[i] = max(a[i], __shfl_xor_sync(kFull, a[i], off));
      }
      const int nbc = SC >> lg;
      for (int k = tid; k < R * 128; k += kThreads) s_blk[k] = 0;
      __syncthreads();
      if (scale_writer_col && (ty & ((1 << lr) - 1)) == 0) {
#pragma unroll
        for (int i = 0; i < R; ++i) atomicMax(&s_blk[((ty + i * RP) >> p.lbm) * nbc + (tx >> lg)], a[i]);
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (!g[i].ok) continue;
        const int r = r0 + ty + i * RP;
        const uint32_t ab = s_blk[((ty + i * RP) >> p.lbm) * nbc + (tx >> lg)];
        float v[16];
        decode<S>(p, g[i], c, src_amax, v);
        encode(v, params(ab, r, scale_writer_col && (r & ((1 << p.lbm) - 1)) == 0), r);
      }
    }
    if constexpr (D == D_MXCW) {  // columnwise copy: e8m0 per (32-row block, column), encode pass
      __syncthreads();
      uint8_t* cwd = reinterpret_cast<uint8_t*>(p.d_cw_data);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (!g[i].ok) continue;
        const int r = r0 + ty + i * RP;
        const uint32_t* col = &s_col[((ty + i * RP) >> 5) * TC + tx * 16];
        float v[16];
        decode<S>(p, g[i], c, src_amax, v);
        uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const uint8_t e = mx_scale_from_amax(amax_from_bits(col[j]));
          if ((r & 31) == 0 && c + j < p.K) p.d_cw_scale[(b * ((p.M + 31) >> 5) + (r >> 5)) * (int64_t)p.K + c + j] = e;
          w[j >> 2] |= (uint32_t)cast_e4m3(v[j] * e8m0_rcp(e)) << (8 * (j & 3));
        }
        uint8_t* out = cwd + (b * p.M + r) * (int64_t)p.K + c;
        if (p.vec) {
          *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
#pragma unroll
          for (int j = 0; j < 16; ++j)
            if (c + j < p.K) out[j] = (uint8_t)(w[j >> 2] >> (8 * (j & 3)));
        }
      }
    }
  }
}

// One tile per CTA: issue all loads, then decode / reduce / encode.
template <int S, int D>
__global__ void __launch_bounds__(kThreads, min_blocks_for(S, D)) requant_kernel(const Params p) {
  constexpr int R = rows_for(S, D);
  __shared__ uint32_t s_blk[(D == D_FP8B || is_nv(D)) ? R * 128 : 1];
  __shared__ uint32_t s_col[(D == D_MXCW) ? R * 128 : 1];
  __shared__ float s_enc[D == D_NV ? 256 : 1];
  const Tile t = tile_of<R>(p, blockIdx.x);
  Seg<S> g[R];
  load_tile<S, R>(p, t, g);
  if constexpr (D == D_NV) {
    // nvfp4 encode multiplier of every block-scale byte s, enc = fminf(1 / (float(s) * S_dec), FLT_MAX)
    // (numerics.h nvfp4_enc, bit for bit): one division per thread and CTA instead of one per block.
    static_assert(kThreads == 256, "one table entry per thread");
    s_enc[threadIdx.x] = nvfp4_enc(fp8_to_float((uint8_t)threadIdx.x, false), nvfp4_tensor(p.t_amax[t.b]));
    __syncthreads();
  }
  process_tile<S, D, R>(p, t, g, s_blk, s_col, s_enc);
}

// ------------------------------------------------------------------- streaming nvfp4 1x16 encode
// bf16 / fp16 -> nvfp4 with 1x16 blocks and K % 16 == 0 (aligned): every 16-element block is 32
// contiguous source bytes -> 8 data bytes + 1 scale byte at the same block index, so the whole
// batch is one 1-D stream of blocks. Persistent CTAs walk tiles of kNvTile blocks (16 KB of
// source); each tile comes into shared memory by one bulk asynchronous copy (cp.async.bulk, done
// by the sm_90 TMA unit, completion on an mbarrier) kNvStages tiles ahead, so the loads stay in flight
// while the CTA computes and without holding registers (the one-tile-per-CTA kernel above stalls
// between its loads and its stores). Thread t encodes blocks t and t + 256 of a tile: the scale
// bytes and the 8-byte data words of a warp are contiguous. Per block: amax from the raw words,
// scale byte, enc from the per-CTA table, E2M1 by nvfp4_pack8 (the same numerics as process_tile).
// Two-pass (amax computed): the amax kernel runs first and the tiles are walked in reverse, so the
// first tiles read are the ones the amax pass read last (in L2); the stores are evict-first (st.cs)
// so that they do not push those tiles out.
// Pipeline shape: 4 stages per CTA x 3 CTAs per SM (3x4 measured the same, 6x2 slower: docs/benchmarks.md).
constexpr int kNvStages = 4, kNvCtasPerSm = 3;
constexpr int kNvTile = 2 * kThreads;  // blocks per tile
constexpr int kNvTileBytes = kNvTile * 32;
__host__ __device__ constexpr size_t nv_smem_bytes(int nst) {
  return (size_t)nst * kNvTileBytes + 256 * sizeof(float) + nst * sizeof(uint64_t);
}

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) { return (uint32_t)__cvta_generic_to_shared(ptr); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred P;\n"
      "NV1D_WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      " @!P bra NV1D_WAIT_%=;\n}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// One bulk copy of `bytes` (multiple of 16, 16-byte aligned) global -> shared, completing on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // our generic reads of dst before the async write
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Index of the matrix that block `blk` lies in (blk / bpm) without a 64-bit integer division:
// the fp64 quotient is off by at most one (blk < 2^42), then corrected.
__device__ __forceinline__ int64_t matrix_of(int64_t blk, int64_t bpm, double inv_bpm) {
  int64_t q = (int64_t)((double)blk * inv_bpm);
  const int64_t r = blk - q * bpm;
  q += r < 0 ? -1 : (r >= bpm ? 1 : 0);
  return q;
}

// Persistent CTAs stream their tiles (blockIdx.x + k * gridDim.x; reversed tile numbers when
// p.reverse, the two-pass order: the tiles the amax kernel read last are likely still in L2),
// kNvStages tiles in flight per CTA via cp.async.bulk while the CTA encodes.
template <int S>
__global__ void __launch_bounds__(kThreads, kNvCtasPerSm) nv1d_kernel(const Params p) {
  static_assert(S == S_BF16 || S == S_F16, "16-bit sources");
  extern __shared__ __align__(128) uint8_t nv_smem[];
  uint4* buf = reinterpret_cast<uint4*>(nv_smem);  // [kNvStages][kNvTile * 2] 16-byte chunks
  float* s_enc = reinterpret_cast<float*>(nv_smem + (size_t)kNvStages * kNvTileBytes);
  uint64_t* bar = reinterpret_cast<uint64_t*>(s_enc + 256);
  const int tid = threadIdx.x;
  const int64_t bpm = (int64_t)p.M * (p.K >> 4);  // blocks per matrix
  const int64_t nblk = p.B * bpm;
  const int64_t ntiles = (nblk + kNvTile - 1) / kNvTile;
  const double inv_bpm = 1.0 / (double)bpm;
  const char* src = reinterpret_cast<const char*>(p.s_data);
  // This CTA's tiles: blockIdx.x + k * gridDim.x, k < my_n (grid <= ntiles, so my_n >= 1).
  const int64_t my_n = (ntiles - 1 - blockIdx.x) / gridDim.x + 1;
  auto tile_at = [&](int64_t k) -> int64_t { return blockIdx.x + k * gridDim.x; };
  auto issue = [&](int64_t ti, int st) {  // bulk load of tile ti into stage st
    const int64_t nb = min((int64_t)kNvTile, nblk - ti * kNvTile);
    bulk_load(buf + (size_t)st * (kNvTile * 2), src + ti * kNvTileBytes, (uint32_t)(nb * 32), &bar[st]);
  };
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < kNvStages; ++st) mbar_init(&bar[st], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // The 16-byte halves of a block are read in swizzled order (threads 4..7 of each 8 start with
  // the second half) so that a quarter-warp's 16-byte reads hit 32 distinct banks.
  const int h0 = (tid >> 2) & 1;
  auto read_stage = [&](int st, uint4 (&raw)[2][2]) {
    const uint4* sb = buf + (size_t)st * (kNvTile * 2);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int lb = tid + j * kThreads;
      raw[j][0] = sb[2 * lb + h0];
      raw[j][1] = sb[2 * lb + (h0 ^ 1)];
    }
  };

  // ---- encode: sequence q = 0..my_n-1 in tile order (reversed tile numbers when p.reverse).
  auto tile_q = [&](int64_t q) -> int64_t {
    const int64_t tl = tile_at(q);
    return p.reverse ? ntiles - 1 - tl : tl;
  };
  auto stage_q = [&](int64_t q) -> int { return (int)(q % kNvStages); };
  if (tid == 0)
    for (int64_t q = 0; q < kNvStages && q < my_n; ++q) issue(tile_q(q), stage_q(q));
  int64_t b_tab = -1;
  Nvfp4Tensor T{};
  for (int64_t q = 0; q < my_n; ++q) {
    const int64_t ti = tile_q(q);
    const int st = stage_q(q);
    const int64_t blk0 = ti * kNvTile;
    const int64_t nb = min((int64_t)kNvTile, nblk - blk0);
    const int64_t b_first = p.B == 1 ? 0 : matrix_of(blk0, bpm, inv_bpm);
    const int64_t b_last = p.B == 1 ? 0 : matrix_of(blk0 + nb - 1, bpm, inv_bpm);
    mbar_wait(&bar[st], (uint32_t)((q / kNvStages) & 1));
    uint4 raw[2][2];
    read_stage(st, raw);
    __syncthreads();  // every thread has read stage st (and finished the previous tile)
    if (tid == 0 && q + kNvStages < my_n) issue(tile_q(q + kNvStages), stage_q(q + kNvStages));
    if (b_first != b_tab) {  // uniform: (re)build the enc table of this tile's first matrix
      T = nvfp4_tensor(p.t_amax[b_first]);
      s_enc[tid] = nvfp4_enc(fp8_to_float((uint8_t)tid, false), T);
      b_tab = b_first;
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int lb = tid + j * kThreads;
      if (lb >= nb) continue;
      const int64_t blk = blk0 + lb;
      // the half read first, then the other
      const uint32_t w[8] = {raw[j][0].x, raw[j][0].y, raw[j][0].z, raw[j][0].w,
                             raw[j][1].x, raw[j][1].y, raw[j][1].z, raw[j][1].w};
      const float amax = amax_from_bits(seg_amax_16bit<S>(w));
      Nvfp4Tensor Tb = T;
      const bool other = b_first != b_last && matrix_of(blk, bpm, inv_bpm) != b_first;  // a tile across matrices
      if (other) Tb = nvfp4_tensor(p.t_amax[matrix_of(blk, bpm, inv_bpm)]);
      const uint8_t sbyte = (uint8_t)(cvt_fp8x2(amax * Tb.s_enc_div6, 0.0f, false) & 0xFFu);
      const float enc = other ? nvfp4_enc(fp8_to_float(sbyte, false), Tb) : s_enc[sbyte];
      float x[16];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (S == S_BF16) {
          x[2 * i] = __uint_as_float(w[i] << 16) * enc;
          x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u) * enc;
        } else {
          x[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xFFFFu))) * enc;
          x[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16))) * enc;
        }
      }
      const uint32_t c0 = nvfp4_pack8(x), c1 = nvfp4_pack8(x + 8);
      __stcs(reinterpret_cast<uint2*>(p.d_data) + blk, h0 ? make_uint2(c1, c0) : make_uint2(c0, c1));
      __stcs(reinterpret_cast<char*>(p.d_scale) + blk, (char)sbyte);
    }
  }
}

// -------------------------------------------------------------------------- launchers
template <int S, int D>
void launch_requant(const Params& p, int64_t grid, cudaStream_t stream) {
  requant_kernel<S, D><<<(unsigned)grid, kThreads, 0, stream>>>(p);
}

// Streaming nvfp4 encode (nv1d_kernel): persistent grid of up to kNvCtasPerSm CTAs per SM.
template <int S>
cudaError_t launch_nv1d(const Params& p, cudaStream_t stream) {
  constexpr size_t smem = nv_smem_bytes(kNvStages);
  static int max_ctas = 0;  // per process: CTAs that fit on the device at once
  if (max_ctas == 0) {
    int dev = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaFuncSetAttribute(nv1d_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, nv1d_kernel<S>, kThreads, smem);
    max_ctas = sms * (per_sm > 0 ? per_sm : 1);
  }
  const int64_t nblk = p.B * (int64_t)p.M * (p.K >> 4);
  const int64_t ntiles = (nblk + kNvTile - 1) / kNvTile;
  const int grid = (int)(ntiles < max_ctas ? ntiles : max_ctas);
  nv1d_kernel<S><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int S>
void launch_amax(const Params& p, uint32_t* out, int64_t grid, cudaStream_t stream) {
  amax_kernel<S><<<(unsigned)grid, kThreads, 0, stream>>>(p, out);
}

}  // namespace cudak
}  // namespace ckptq

#define CKPTQ_INSTANTIATE_DST(D)                                                         \
  template void ckptq::cudak::launch_requant<ckptq::cudak::S_F32, D>(const ckptq::cudak::Params&, int64_t, cudaStream_t);  \
  template void ckptq::cudak::launch_requant<ckptq::cudak::S_BF16, D>(const ckptq::cudak::Params&, int64_t, cudaStream_t); \
  template void ckptq::cudak::launch_requant<ckptq::cudak::S_F16, D>(const ckptq::cudak::Params&, int64_t, cudaStream_t);  \
  template void ckptq::cudak::launch_requant<ckptq::cudak::S_FP8, D>(const ckptq::cudak::Params&, int64_t, cudaStream_t);  \
  template void ckptq::cudak::launch_requant<ckptq::cudak::S_MX, D>(const ckptq::cudak::Params&, int64_t, cudaStream_t);   \
  template void ckptq::cudak::launch_requant<ckptq::cudak::S_NV, D>(const ckptq::cudak::Params&, int64_t, cudaStream_t);  \
  template void ckptq::cudak::launch_requant<ckptq::cudak::S_MX4, D>(const ckptq::cudak::Params&, int64_t, cudaStream_t);
