// Host-side plan of one ckptq::requantize / ckptq::amax call, shared by the CPU and CUDA
// implementations: parses the op's arguments, checks them (TORCH_CHECK, messages name the
// format, shape and dtype), and allocates the outputs in the canonical compact layout of
// docs/formats.md. Everything is in an anonymous namespace: each extension gets its own copy.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <vector>

#include "numerics.h"

namespace ckptq {
namespace {

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline Fmt parse_fmt(c10::string_view s, const char* which) {
  const std::string n(s.data(), s.size());
  if (n == "fp32" || n == "float32") return Fmt::F32;
  if (n == "bf16" || n == "bfloat16") return Fmt::BF16;
  if (n == "fp16" || n == "float16") return Fmt::F16;
  if (n == "fp8_tensor") return Fmt::FP8_TENSOR;
  if (n == "fp8_block") return Fmt::FP8_BLOCK;
  if (n == "mxfp8") return Fmt::MXFP8;
  if (n == "nvfp4") return Fmt::NVFP4;
  if (n == "mxfp4") return Fmt::MXFP4;
  TORCH_CHECK(false, "ckptq: unknown ", which, " format '", n,
              "'; expected one of fp32, bf16, fp16, fp8_tensor, fp8_block, mxfp8, nvfp4, mxfp4");
  return Fmt::F32;
}

inline const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::F32: return "fp32";
    case Fmt::BF16: return "bf16";
    case Fmt::F16: return "fp16";
    case Fmt::FP8_TENSOR: return "fp8_tensor";
    case Fmt::FP8_BLOCK: return "fp8_block";
    case Fmt::MXFP8: return "mxfp8";
    case Fmt::NVFP4: return "nvfp4";
    case Fmt::MXFP4: return "mxfp4";
  }
  return "?";
}

// The op's scale_rule string (an mxfp4 target's E8M0 scale rule; "" means floor).
inline num::Mxfp4Rule parse_mxfp4_rule(c10::string_view s) {
  const std::string n(s.data(), s.size());
  if (n.empty() || n == "floor") return num::Mxfp4Rule::FLOOR;
  if (n == "even") return num::Mxfp4Rule::EVEN;
  if (n == "ceil") return num::Mxfp4Rule::CEIL;
  if (n == "rceil") return num::Mxfp4Rule::RCEIL;
  TORCH_CHECK(false, "ckptq: unknown mxfp4 scale_rule '", n, "'; expected one of floor, even, ceil, rceil");
  return num::Mxfp4Rule::FLOOR;
}

inline at::ScalarType hp_dtype(Fmt f) {
  return f == Fmt::F32 ? at::kFloat : (f == Fmt::BF16 ? at::kBFloat16 : at::kHalf);
}

inline std::vector<int64_t> cat_shape(at::IntArrayRef batch, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> s(batch.begin(), batch.end());
  s.insert(s.end(), tail.begin(), tail.end());
  return s;
}

// Block shape of a blocked format from the op's int[] argument (checked).
inline std::pair<int64_t, int64_t> parse_block(Fmt f, at::IntArrayRef blk, const char* which) {
  switch (f) {
    case Fmt::FP8_BLOCK:
      TORCH_CHECK(blk.size() == 2 && blk[0] >= 1 && blk[1] >= 1, "ckptq: ", which,
                  " fp8_block needs block=[bm, bk] of two positive ints, got ", blk);
      return {blk[0], blk[1]};
    case Fmt::MXFP8:
    case Fmt::MXFP4:
      TORCH_CHECK(blk.empty() || (blk.size() == 2 && blk[0] == 1 && blk[1] == 32), "ckptq: ", which, " ",
                  fmt_name(f), " blocks are [1, 32], got ", blk);
      return {1, 32};
    case Fmt::NVFP4:
      TORCH_CHECK(blk.empty() || (blk.size() == 2 && blk[1] == 16 && (blk[0] == 1 || blk[0] == 16)),
                  "ckptq: ", which, " nvfp4 blocks are [1, 16] or [16, 16], got ", blk);
      return {blk.empty() ? 1 : blk[0], 16};
    default:
      return {0, 0};  // per tensor / no blocks
  }
}

struct Plan {
  Fmt sf = Fmt::F32, df = Fmt::F32;
  std::vector<int64_t> batch;  // batch shape (leading dims)
  int64_t B = 1, M = 0, K = 0;
  // source
  at::Tensor s_data, s_scale, s_amax;  // contiguous; undefined where the format has none
  int64_t sbm = 1, sbk = 1;            // source block (per tensor: M, K); hp: unused
  int64_t s_srows = 1, s_scols = 1;    // source scale grid per matrix
  bool s_e5m2 = false;
  // target
  int64_t bm = 1, bk = 1;  // target block (per tensor / hp: unused)
  bool d_e5m2 = false, pow2 = false, columnwise = false;
  float eps = 0.0f;
  num::Mxfp4Rule mx_rule = num::Mxfp4Rule::FLOOR;  // mxfp4 target
  at::Tensor amax_in, scale_in;  // fp32 (B,) contiguous, or undefined
  std::vector<at::Tensor> outs;  // in canonical component order
  at::Device device = at::kCPU;

  bool needs_tensor_amax() const {
    return (df == Fmt::NVFP4 || df == Fmt::FP8_TENSOR) && !amax_in.defined() && !scale_in.defined();
  }
};

inline void check_shape(const at::Tensor& t, const std::vector<int64_t>& want, const char* fmt,
                        const char* comp) {
  TORCH_CHECK(t.sizes().vec() == want, "ckptq: ", fmt, " component '", comp, "' has shape ", t.sizes(),
              ", expected ", at::IntArrayRef(want), " for the logical shape given by 'data'");
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* fmt, const char* comp) {
  TORCH_CHECK(t.scalar_type() == want, "ckptq: ", fmt, " component '", comp, "' has dtype ",
              t.scalar_type(), ", expected ", want);
}

// Parse the source components (list order = canonical component order of the format).
inline void plan_source(Plan& p, at::TensorList src, c10::string_view src_format, at::IntArrayRef src_block) {
  p.sf = parse_fmt(src_format, "source");
  const char* fn = fmt_name(p.sf);
  const size_t need = fmt_is_hp(p.sf) ? 1 : (p.sf == Fmt::NVFP4 ? 3 : 2);
  TORCH_CHECK(src.size() >= need, "ckptq: source format ", fn, " takes ", need, " component tensors (",
              fmt_is_hp(p.sf) ? "x" : (p.sf == Fmt::NVFP4 ? "data, scale, amax" : "data, scale"),
              "), got ", src.size());
  const at::Tensor& data = src[0];
  TORCH_CHECK(data.dim() >= 2, "ckptq: source ", fn, " data must have rank >= 2 (..., M, K), got shape ",
              data.sizes());
  p.device = data.device();
  for (size_t i = 0; i < need; ++i)
    TORCH_CHECK(src[i].device() == p.device, "ckptq: source ", fn, " components are on different devices (",
                src[i].device(), " vs ", p.device, ")");
  const int64_t nd = data.dim();
  p.batch.assign(data.sizes().begin(), data.sizes().end() - 2);
  p.B = 1;
  for (int64_t d : p.batch) p.B *= d;
  p.M = data.size(nd - 2);
  const int64_t last = data.size(nd - 1);
  p.K = fmt_is_fp4(p.sf) ? 2 * last : last;
  p.s_data = data.contiguous();
  auto blk = parse_block(p.sf, src_block, "source");
  switch (p.sf) {
    case Fmt::F32:
    case Fmt::BF16:
    case Fmt::F16:
      check_dtype(data, hp_dtype(p.sf), fn, "x");
      break;
    case Fmt::FP8_TENSOR:
    case Fmt::FP8_BLOCK: {
      TORCH_CHECK(data.scalar_type() == at::kFloat8_e4m3fn || data.scalar_type() == at::kFloat8_e5m2,
                  "ckptq: source ", fn, " data must be float8_e4m3fn or float8_e5m2, got ", data.scalar_type());
      p.s_e5m2 = data.scalar_type() == at::kFloat8_e5m2;
      check_dtype(src[1], at::kFloat, fn, "scale_inv");
      if (p.sf == Fmt::FP8_TENSOR) {
        check_shape(src[1], p.batch, fn, "scale_inv");
        p.sbm = std::max<int64_t>(p.M, 1);
        p.sbk = std::max<int64_t>(p.K, 1);
        p.s_srows = p.s_scols = 1;
      } else {
        p.sbm = blk.first;
        p.sbk = blk.second;
        p.s_srows = cdiv(p.M, p.sbm);
        p.s_scols = cdiv(p.K, p.sbk);
        check_shape(src[1], cat_shape(p.batch, {p.s_srows, p.s_scols}), fn, "scale_inv");
      }
      p.s_scale = src[1].contiguous();
      break;
    }
    case Fmt::MXFP8:
      check_dtype(data, at::kFloat8_e4m3fn, fn, "data");
      check_dtype(src[1], at::kByte, fn, "scale");
      p.sbm = 1;
      p.sbk = 32;
      p.s_srows = p.M;
      p.s_scols = cdiv(p.K, 32);
      check_shape(src[1], cat_shape(p.batch, {p.s_srows, p.s_scols}), fn, "scale");
      p.s_scale = src[1].contiguous();
      break;
    case Fmt::MXFP4:
      check_dtype(data, at::kByte, fn, "data");
      check_dtype(src[1], at::kByte, fn, "scale");
      p.sbm = 1;
      p.sbk = 32;
      p.s_srows = p.M;
      p.s_scols = cdiv(p.K, 32);
      check_shape(src[1], cat_shape(p.batch, {p.s_srows, p.s_scols}), fn, "scale");
      p.s_scale = src[1].contiguous();
      break;
    case Fmt::NVFP4:
      check_dtype(data, at::kByte, fn, "data");
      check_dtype(src[1], at::kFloat8_e4m3fn, fn, "scale");
      check_dtype(src[2], at::kFloat, fn, "amax");
      p.sbm = blk.first;
      p.sbk = 16;
      p.s_srows = cdiv(p.M, p.sbm);
      p.s_scols = cdiv(p.K, 16);
      check_shape(src[1], cat_shape(p.batch, {p.s_srows, p.s_scols}), fn, "scale");
      check_shape(src[2], p.batch, fn, "amax");
      p.s_scale = src[1].contiguous();
      p.s_amax = src[2].contiguous();
      break;
  }
}

inline at::Tensor per_batch_f32(const at::Tensor& t, const Plan& p, const char* what) {
  TORCH_CHECK(t.device() == p.device, "ckptq: ", what, " is on ", t.device(), " but the source is on ", p.device);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "ckptq: ", what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == p.B, "ckptq: ", what, " must hold one value per matrix (batch shape ",
              at::IntArrayRef(p.batch), "), got shape ", t.sizes());
  return t.contiguous().view({p.B});
}

// Parse the target and allocate its components.
inline void plan_target(Plan& p, c10::string_view dst_format, at::IntArrayRef dst_block,
                        std::optional<at::ScalarType> fp8_dtype, bool pow2, double eps, bool columnwise,
                        const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale,
                        c10::string_view scale_rule) {
  p.df = parse_fmt(dst_format, "target");
  const char* fn = fmt_name(p.df);
  auto blk = parse_block(p.df, dst_block, "target");
  p.bm = blk.first;
  p.bk = blk.second;
  p.pow2 = pow2;
  p.eps = (float)eps;
  p.columnwise = columnwise;
  TORCH_CHECK(scale_rule.empty() || p.df == Fmt::MXFP4, "ckptq: scale_rule= applies only to an mxfp4 target, not ", fn);
  p.mx_rule = parse_mxfp4_rule(scale_rule);
  TORCH_CHECK(!columnwise || p.df == Fmt::MXFP8, "ckptq: columnwise=True applies only to an mxfp8 target, not ", fn);
  const bool fp8_target = p.df == Fmt::FP8_TENSOR || p.df == Fmt::FP8_BLOCK;
  if (fp8_target) {
    TORCH_CHECK(fp8_dtype.has_value() &&
                    (*fp8_dtype == at::kFloat8_e4m3fn || *fp8_dtype == at::kFloat8_e5m2),
                "ckptq: target ", fn, " needs fp8_dtype float8_e4m3fn or float8_e5m2");
    p.d_e5m2 = *fp8_dtype == at::kFloat8_e5m2;
  }
  if (amax.has_value()) {
    TORCH_CHECK(p.df == Fmt::NVFP4 || p.df == Fmt::FP8_TENSOR,
                "ckptq: amax= applies only to nvfp4 and fp8_tensor targets, not ", fn);
    p.amax_in = per_batch_f32(*amax, p, "amax");
  }
  if (scale.has_value()) {
    TORCH_CHECK(p.df == Fmt::FP8_TENSOR, "ckptq: scale= applies only to an fp8_tensor target, not ", fn);
    p.scale_in = per_batch_f32(*scale, p, "scale");
  }
  TORCH_CHECK(!fmt_is_fp4(p.df) || p.K % 2 == 0, "ckptq: ", fn,
              " packs two values per byte, so the last dim K must be even; got K = ", p.K);
  auto opt = at::TensorOptions().device(p.device);
  const int64_t M = p.M, K = p.K;
  const auto& bt = p.batch;
  switch (p.df) {
    case Fmt::F32:
    case Fmt::BF16:
    case Fmt::F16:
      p.outs = {at::empty(cat_shape(bt, {M, K}), opt.dtype(hp_dtype(p.df)))};
      break;
    case Fmt::FP8_TENSOR:
      p.outs = {at::empty(cat_shape(bt, {M, K}), opt.dtype(*fp8_dtype)), at::empty(bt, opt.dtype(at::kFloat))};
      break;
    case Fmt::FP8_BLOCK:
      p.outs = {at::empty(cat_shape(bt, {M, K}), opt.dtype(*fp8_dtype)),
                at::empty(cat_shape(bt, {cdiv(M, p.bm), cdiv(K, p.bk)}), opt.dtype(at::kFloat))};
      break;
    case Fmt::MXFP8:
      p.outs = {at::empty(cat_shape(bt, {M, K}), opt.dtype(at::kFloat8_e4m3fn)),
                at::empty(cat_shape(bt, {M, cdiv(K, 32)}), opt.dtype(at::kByte))};
      if (columnwise) {
        p.outs.push_back(at::empty(cat_shape(bt, {M, K}), opt.dtype(at::kFloat8_e4m3fn)));
        p.outs.push_back(at::empty(cat_shape(bt, {cdiv(M, 32), K}), opt.dtype(at::kByte)));
      }
      break;
    case Fmt::NVFP4:
      p.outs = {at::empty(cat_shape(bt, {M, K / 2}), opt.dtype(at::kByte)),
                at::empty(cat_shape(bt, {cdiv(M, p.bm), cdiv(K, 16)}), opt.dtype(at::kFloat8_e4m3fn)),
                at::empty(bt, opt.dtype(at::kFloat))};
      break;
    case Fmt::MXFP4:
      p.outs = {at::empty(cat_shape(bt, {M, K / 2}), opt.dtype(at::kByte)),
                at::empty(cat_shape(bt, {M, cdiv(K, 32)}), opt.dtype(at::kByte))};
      break;
  }
}

inline Plan make_plan(at::TensorList src, c10::string_view src_format, at::IntArrayRef src_block,
                      c10::string_view dst_format, at::IntArrayRef dst_block,
                      std::optional<at::ScalarType> fp8_dtype, bool pow2, double eps, bool columnwise,
                      const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale,
                      c10::string_view scale_rule) {
  Plan p;
  plan_source(p, src, src_format, src_block);
  plan_target(p, dst_format, dst_block, fp8_dtype, pow2, eps, columnwise, amax, scale, scale_rule);
  return p;
}

}  // namespace
}  // namespace ckptq
