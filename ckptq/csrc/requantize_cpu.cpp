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
// plain element loops the compiler vectorizes, and tiles are spread over at::parallel_for.
#include <Python.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

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

// --------------------------------------------------------------------------- decode
struct SrcCpu {
  Fmt f;
  const uint8_t* data;
  const float* lut;        // fp8 / mxfp8 element table
  const float* e4m3;       // nvfp4 scale table
  const float* sc_f32;     // fp8 scale_inv grid
  const uint8_t* sc_u8;    // mxfp8 e8m0 / nvfp4 e4m3 scale grid
  const float* amax;       // nvfp4 per matrix
  int64_t M, K, sbm, sbk, srows, scols;
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
  s.e4m3 = tb.e4m3;
  if (p.sf == Fmt::FP8_TENSOR || p.sf == Fmt::FP8_BLOCK) s.sc_f32 = p.s_scale.data_ptr<float>();
  if (p.sf == Fmt::MXFP8 || p.sf == Fmt::NVFP4) s.sc_u8 = (const uint8_t*)p.s_scale.data_ptr();
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
  if (c0 % s.sbk == 0 && cdiv(n, s.sbk) <= kMaxBlocks && (s.f != Fmt::NVFP4 || n % 2 == 0)) {
    // Common case: the chunk starts on a block boundary; multipliers first, then one loop.
    float mult[kMaxBlocks];
    const int64_t nb = cdiv(n, s.sbk), b0 = c0 / s.sbk;
    switch (s.f) {
      case Fmt::FP8_TENSOR:
      case Fmt::FP8_BLOCK:
        for (int64_t j = 0; j < nb; ++j) mult[j] = s.sc_f32[srow + b0 + j];
        fp8_decode_blocks(s.data + row * s.K + c0, n, s.sbk, s.lut, mult, out);
        return;
      case Fmt::MXFP8:
        for (int64_t j = 0; j < nb; ++j) mult[j] = e8m0_to_f32(s.sc_u8[srow + b0 + j]);
        fp8_decode_blocks(s.data + row * s.K + c0, n, s.sbk, s.lut, mult, out);
        return;
      case Fmt::NVFP4: {
        const float amax = s.amax[b];
        for (int64_t j = 0; j < nb; ++j) mult[j] = nvfp4_dec_mult(s.e4m3[s.sc_u8[srow + b0 + j]], amax);
        nvfp4_decode_blocks(s.data + row * (s.K / 2) + c0 / 2, n, mult, out);
        return;
      }
      default:
        break;
    }
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
      case Fmt::NVFP4: {  // x = e2m1(code) * ((float(s) * amax) * (1/2688))
        const float m = nvfp4_dec_mult(s.e4m3[s.sc_u8[srow + blk]], s.amax[b]);
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
  at::parallel_for(0, B * M, grain, [&](int64_t beg, int64_t end) {
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
        decode_row(s, b, r, c0, n, buf.data());
        const uint32_t a = seg_amax_bits(buf.data(), n);
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
  at::parallel_for(0, B * M, grain, [&](int64_t beg, int64_t end) {
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
            bf16_out_row(v, n, tb.bf16_nan, (uint16_t*)out + o);
            break;
          case Fmt::F16:
            f16_out_row(v, n, (uint16_t*)out + o);
            break;
          case Fmt::FP8_TENSOR:  // data = sat_rne(x * scale)
            cast_fp8_row(v, n, tensor_scale[b], (uint8_t*)out + o, p.d_e5m2);
            break;
          default:
            TORCH_INTERNAL_ASSERT(false);
        }
      }
    }
  });
}

// Blocked targets: fp8_block (bm, bk), mxfp8 (1, 32) [+ (32, 1) columnwise], nvfp4 (1|16, 16).
void run_blocked(const Plan& p, const SrcCpu& s, const std::vector<Nvfp4Tensor>& nvt) {
  const int64_t M = p.M, K = p.K, B = p.B;
  if (B * M == 0 || K == 0) return;
  const int64_t bm = p.bm, bk = p.bk;
  const bool cw = p.columnwise;
  const int64_t TR = cw ? 32 : bm;                     // tile rows
  const int64_t W = bk >= 512 ? bk : bk * (512 / bk);  // tile cols (whole blocks)
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
  const int64_t data_row = df == Fmt::NVFP4 ? K / 2 : K;  // bytes per row of data

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
  auto encode = [&](const float* v, int64_t n, const float* mult, int64_t row, int64_t c) {
    if (df == Fmt::NVFP4)
      nvfp4_blocks(v, n, mult, data + row * data_row + c / 2);
    else if (df == Fmt::FP8_BLOCK && p.d_e5m2)
      e5m2_blocks(v, n, bk, mult, data + row * data_row + c);
    else
      e4m3_blocks(v, n, bk, mult, data + row * data_row + c);
  };

  const int64_t grain = std::max<int64_t>(1, 32768 / (TR * W));
  at::parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(W);
    std::vector<uint32_t> amax(cdiv(W, bk)), ramax, camax;
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
      // Pass 1: block amaxes; blocks of one row are encoded at once.
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t row = b * M + r;
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
        decode_row(s, b, r, c0, n, v);
        if (bm > 1) encode(v, n, rmult.data() + ((r - r0) / bm) * nbc, row, c0);
        if (cw) cast_e4m3_cols(v, n, cmult.data(), cw_data + row * K + c0);
      }
    }
  });
}

// ------------------------------------------------------------------------------ ops
std::vector<at::Tensor> requantize_cpu(at::TensorList src, c10::string_view src_format, at::IntArrayRef src_block,
                                       c10::string_view dst_format, at::IntArrayRef dst_block,
                                       std::optional<at::ScalarType> fp8_dtype, bool pow2, double eps,
                                       bool columnwise, const std::optional<at::Tensor>& amax,
                                       const std::optional<at::Tensor>& scale) {
  Plan p = make_plan(src, src_format, src_block, dst_format, dst_block, fp8_dtype, pow2, eps, columnwise, amax, scale);
  TORCH_INTERNAL_ASSERT(p.device.is_cpu());
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
