// CUDA backend of ckptq::requantize and ckptq::amax (registered under the CUDA dispatch key).
// Host side: the shared plan (requantize.h) -> kernel parameters, tile shape, launches on the
// current stream. Kernels: kernels.cuh (instantiated in inst_*.cu).
#include <Python.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>

#include "../requantize.h"
#include "kernels.cuh"

#define CKPTQ_EXTERN_DST(D)                                                           \
  extern template void launch_requant<S_F32, D>(const Params&, int64_t, cudaStream_t);  \
  extern template void launch_requant<S_BF16, D>(const Params&, int64_t, cudaStream_t); \
  extern template void launch_requant<S_F16, D>(const Params&, int64_t, cudaStream_t);  \
  extern template void launch_requant<S_FP8, D>(const Params&, int64_t, cudaStream_t);  \
  extern template void launch_requant<S_MX, D>(const Params&, int64_t, cudaStream_t);   \
  extern template void launch_requant<S_NV, D>(const Params&, int64_t, cudaStream_t);   \
  extern template void launch_requant<S_MX4, D>(const Params&, int64_t, cudaStream_t);

// The requantize kernels are instantiated in inst_*.cu (compiled in parallel).
namespace ckptq {
namespace cudak {
CKPTQ_EXTERN_DST(D_F32)
CKPTQ_EXTERN_DST(D_BF16)
CKPTQ_EXTERN_DST(D_F16)
CKPTQ_EXTERN_DST(D_FP8T)
CKPTQ_EXTERN_DST(D_FP8B)
CKPTQ_EXTERN_DST(D_MX)
CKPTQ_EXTERN_DST(D_MXCW)
CKPTQ_EXTERN_DST(D_NV)
CKPTQ_EXTERN_DST(D_NVB)
CKPTQ_EXTERN_DST(D_MX4)
extern template cudaError_t launch_nv1d<S_BF16>(const Params&, cudaStream_t);
extern template cudaError_t launch_nv1d<S_F16>(const Params&, cudaStream_t);
}  // namespace cudak
}  // namespace ckptq

namespace ckptq {
namespace {

using namespace cudak;

int ilog2(int64_t v) {
  int l = 0;
  while ((int64_t(1) << l) < v) ++l;
  return l;
}
bool is_pow2(int64_t v) { return v >= 1 && (v & (v - 1)) == 0; }
bool aligned(const void* ptr, int64_t n) { return (reinterpret_cast<uintptr_t>(ptr) % n) == 0; }

int src_kind(Fmt f) {
  switch (f) {
    case Fmt::F32: return S_F32;
    case Fmt::BF16: return S_BF16;
    case Fmt::F16: return S_F16;
    case Fmt::FP8_TENSOR:
    case Fmt::FP8_BLOCK: return S_FP8;
    case Fmt::MXFP8: return S_MX;
    case Fmt::NVFP4: return S_NV;
    case Fmt::MXFP4: return S_MX4;
  }
  return -1;
}

// nvfp4 encode kernel choice, CKPTQ_NVFP4_ENCODE (benchmark switches; the bytes are the same):
// unset = the streaming kernel for bf16 / fp16 1x16 (two-pass: amax kernel, then the streaming
// kernel in reverse tile order); "tile" = the new encode arithmetic in the one-tile-per-CTA kernel;
// "baseline" = the earlier encode (D_NVB: per-block division, threshold-style E2M1 rounding). Read
// at every call (the benchmark switches it within one process).
enum class NvMode { Stream, Tile, Baseline };
NvMode nvfp4_mode() {
  const char* v = std::getenv("CKPTQ_NVFP4_ENCODE");
  if (v == nullptr || *v == 0) return NvMode::Stream;
  if (std::strcmp(v, "tile") == 0) return NvMode::Tile;
  if (std::strcmp(v, "baseline") == 0) return NvMode::Baseline;
  TORCH_CHECK(false, "ckptq: CKPTQ_NVFP4_ENCODE must be unset, tile or baseline; got '", v, "'");
  return NvMode::Stream;
}

int dst_kind(const Plan& p) {
  switch (p.df) {
    case Fmt::F32: return D_F32;
    case Fmt::BF16: return D_BF16;
    case Fmt::F16: return D_F16;
    case Fmt::FP8_TENSOR: return D_FP8T;
    case Fmt::FP8_BLOCK: return D_FP8B;
    case Fmt::MXFP8: return p.columnwise ? D_MXCW : D_MX;
    case Fmt::NVFP4: return D_NV;
    case Fmt::MXFP4: return D_MX4;
  }
  return -1;
}

// Source-side parameters (shared by both ops).
void fill_source(Params& k, const Plan& p) {
  TORCH_CHECK(p.M < (int64_t(1) << 31) && p.K < (int64_t(1) << 31), "ckptq (cuda): matrix dims must be < 2^31, got (",
              p.M, ", ", p.K, ")");
  k.B = p.B;
  k.M = (int32_t)p.M;
  k.K = (int32_t)p.K;
  k.s_data = p.s_data.data_ptr();
  k.s_scale = p.s_scale.defined() ? p.s_scale.data_ptr() : nullptr;
  k.s_amax = p.s_amax.defined() ? p.s_amax.data_ptr<float>() : nullptr;
  k.s_e5m2 = p.s_e5m2;
  k.s_srows = (int32_t)p.s_srows;
  k.s_scols = (int32_t)p.s_scols;
  if (p.sf == Fmt::FP8_TENSOR) {
    k.s_lbm = k.s_lbk = 31;  // one scale per matrix: r >> 31 == c >> 31 == 0
  } else if (p.sf == Fmt::FP8_BLOCK || p.sf == Fmt::MXFP8 || p.sf == Fmt::NVFP4 || p.sf == Fmt::MXFP4) {
    TORCH_CHECK(is_pow2(p.sbm) && is_pow2(p.sbk) && p.sbk >= 16, "ckptq (cuda): source ", fmt_name(p.sf), " block (",
                p.sbm, ", ", p.sbk, ") is not supported by the CUDA kernels (power-of-two blocks with >= 16 columns); ",
                "ckptq.ops uses the reference backend for it");
    k.s_lbm = ilog2(p.sbm);
    k.s_lbk = ilog2(p.sbk);
  }
}

// Tile shape for G segments per target block column (1 for unblocked targets), source kind S and
// target kind D (-1: the amax kernel): TR = (256 / SC) * rows_for(S, D) rows x TC = 16 * SC columns.
int64_t tile_rows(const Params& k, int S, int D) { return (int64_t)(kThreads >> k.lsc) * rows_for(S, D); }

void fill_tiling(Params& k, int64_t M, int64_t K, int G, int S, int D, int64_t bm = 1) {
  int sc = 1;  // segments per tile row: the source's preference, no wider than K needs,
  while (sc < seg_cols_for(S) && sc * 16 < K) sc <<= 1;
  sc = std::max(sc, G);  // at least one target block wide,
  k.lsc = ilog2(sc);
  while (sc > G && tile_rows(k, S, D) < bm) {  // and narrower when a target block needs more rows
    sc >>= 1;
    k.lsc = ilog2(sc);
  }
  k.ntr = (int32_t)cdiv(M, tile_rows(k, S, D));
  k.ntc = (int32_t)cdiv(K, 16 * sc);
}

int64_t grid_of(const Params& k) {
  const int64_t grid = k.B * (int64_t)k.ntr * k.ntc;
  TORCH_CHECK(grid < (int64_t(1) << 31), "ckptq (cuda): too many tiles (", grid, ")");
  return grid;
}

void launch_amax_kernel(const Params& k, uint32_t* out, cudaStream_t st, int S) {
  const int64_t grid = grid_of(k);
  switch (S) {
    case S_F32: launch_amax<S_F32>(k, out, grid, st); break;
    case S_BF16: launch_amax<S_BF16>(k, out, grid, st); break;
    case S_F16: launch_amax<S_F16>(k, out, grid, st); break;
    case S_FP8: launch_amax<S_FP8>(k, out, grid, st); break;
    case S_MX: launch_amax<S_MX>(k, out, grid, st); break;
    case S_NV: launch_amax<S_NV>(k, out, grid, st); break;
    case S_MX4: launch_amax<S_MX4>(k, out, grid, st); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int S>
void launch_for_dst(int D, const Params& k, int64_t grid, cudaStream_t st) {
  switch (D) {
    case D_F32: launch_requant<S, D_F32>(k, grid, st); break;
    case D_BF16: launch_requant<S, D_BF16>(k, grid, st); break;
    case D_F16: launch_requant<S, D_F16>(k, grid, st); break;
    case D_FP8T: launch_requant<S, D_FP8T>(k, grid, st); break;
    case D_FP8B: launch_requant<S, D_FP8B>(k, grid, st); break;
    case D_MX: launch_requant<S, D_MX>(k, grid, st); break;
    case D_MXCW: launch_requant<S, D_MXCW>(k, grid, st); break;
    case D_NV: launch_requant<S, D_NV>(k, grid, st); break;
    case D_NVB: launch_requant<S, D_NVB>(k, grid, st); break;
    case D_MX4: launch_requant<S, D_MX4>(k, grid, st); break;
  }
}

std::vector<at::Tensor> requantize_cuda(at::TensorList src, c10::string_view src_format, at::IntArrayRef src_block,
                                        c10::string_view dst_format, at::IntArrayRef dst_block,
                                        std::optional<at::ScalarType> fp8_dtype, bool pow2, double eps, bool columnwise,
                                        const std::optional<at::Tensor>& amax, const std::optional<at::Tensor>& scale,
                                        c10::string_view scale_rule) {
  Plan p = make_plan(src, src_format, src_block, dst_format, dst_block, fp8_dtype, pow2, eps, columnwise, amax, scale,
                     scale_rule);
  TORCH_INTERNAL_ASSERT(p.device.is_cuda());
  c10::cuda::CUDAGuard guard(p.device);
  cudaStream_t st = c10::cuda::getCurrentCUDAStream(p.device.index());
  const bool per_tensor = p.df == Fmt::NVFP4 || p.df == Fmt::FP8_TENSOR;
  if (p.B * p.M * p.K == 0) {
    TORCH_CHECK(!p.needs_tensor_amax(), "ckptq: cannot take the per-tensor amax of an empty (", p.M, ", ", p.K,
                ") matrix");
    if (p.df == Fmt::NVFP4 && p.amax_in.defined()) p.outs[2].view({p.B}).copy_(p.amax_in);
    if (p.df == Fmt::FP8_TENSOR && p.B > 0) {  // per-matrix scale_inv of empty matrices, on the host
      at::Tensor v = (p.scale_in.defined() ? p.scale_in : p.amax_in).cpu();
      at::Tensor si = at::empty({p.B}, v.options());
      for (int64_t b = 0; b < p.B; ++b) {
        const float a = v.data_ptr<float>()[b];
        const float sc = p.scale_in.defined() ? a : num::fp8_scale_from_amax(a, p.d_e5m2 ? num::kE5M2Max : num::kE4M3Max, p.pow2, p.eps);
        si.data_ptr<float>()[b] = 1.0f / sc;
      }
      p.outs[1].view({p.B}).copy_(si);
    }
    return p.outs;
  }
  Params k{};
  fill_source(k, p);
  int D = dst_kind(p);
  const NvMode nv_mode = D == D_NV ? nvfp4_mode() : NvMode::Stream;
  if (nv_mode == NvMode::Baseline) D = D_NVB;  // same bytes, the earlier (baseline) encode
  // Target geometry and support (mirrored by ckptq.ops._cuda_supports).
  int G = 1;
  if (p.df == Fmt::FP8_BLOCK || p.df == Fmt::MXFP8 || p.df == Fmt::NVFP4 || p.df == Fmt::MXFP4) {
    TORCH_CHECK(is_pow2(p.bm) && is_pow2(p.bk) && p.bk >= 16 && p.bk <= 512, "ckptq (cuda): target block (", p.bm,
                ", ", p.bk, ") is not supported by the CUDA kernels (power-of-two blocks of 16..512 columns); ",
                "ckptq.ops uses the reference backend for it");
    G = (int)(p.bk / 16);
    k.lbm = ilog2(p.bm);
    k.lbk = ilog2(p.bk);
    k.nsr = (int32_t)cdiv(p.M, p.bm);
    k.nsc = (int32_t)cdiv(p.K, p.bk);
  }
  const int S = src_kind(p.sf);
  fill_tiling(k, p.M, p.K, G, S, D, p.columnwise ? std::max<int64_t>(p.bm, 32) : p.bm);
  TORCH_CHECK(p.bm <= tile_rows(k, S, D), "ckptq (cuda): target block (", p.bm, ", ", p.bk,
              ") has more rows than the kernel tile (", tile_rows(k, S, D), "); ckptq.ops uses the reference backend for it");
  k.d_data = p.outs[0].data_ptr();
  k.d_scale = p.outs.size() > 1 ? p.outs[1].data_ptr() : nullptr;
  k.d_cw_data = p.columnwise ? p.outs[2].data_ptr() : nullptr;
  k.d_cw_scale = p.columnwise ? (uint8_t*)p.outs[3].data_ptr() : nullptr;
  k.d_e5m2 = p.d_e5m2;
  k.pow2 = p.pow2;
  k.eps = p.eps;
  k.columnwise = p.columnwise;
  k.mx_rule = (int32_t)p.mx_rule;
  bool vec = p.K % 16 == 0 && aligned(k.s_data, 16) && aligned(k.d_data, 16);
  if (p.columnwise) vec = vec && aligned(k.d_cw_data, 16);
  k.vec = vec;

  // bf16 / fp16 -> nvfp4 1x16 over contiguous rows of whole blocks: the streaming kernel.
  const bool stream_nv = D == D_NV && k.lbm == 0 && k.vec && (S == S_BF16 || S == S_F16) && nv_mode == NvMode::Stream;

  // Per-matrix amax / scale of the per-tensor targets. ``buf`` must outlive the main launch.
  at::Tensor buf;
  if (per_tensor) {
    if (p.needs_tensor_amax()) {
      buf = p.df == Fmt::NVFP4 ? p.outs[2] : at::empty({p.B}, p.outs[0].options().dtype(at::kFloat));
      buf.zero_();
      Params ka = k;
      fill_tiling(ka, p.M, p.K, 1, S, -1);
      launch_amax_kernel(ka, reinterpret_cast<uint32_t*>(buf.data_ptr()), st, S);
      k.t_amax = buf.data_ptr<float>();
      k.reverse = 1;  // start where the amax pass ended: those tiles are still in L2
    } else if (p.amax_in.defined()) {
      if (p.df == Fmt::NVFP4) {
        p.outs[2].view({p.B}).copy_(p.amax_in);  // stored bit for bit as given
        k.t_amax = p.outs[2].data_ptr<float>();
      } else {
        k.t_amax = p.amax_in.data_ptr<float>();
      }
    }
    if (p.scale_in.defined()) k.t_scale = p.scale_in.data_ptr<float>();
    if (p.df == Fmt::FP8_TENSOR) k.t_scale_inv = p.outs[1].data_ptr<float>();
  }
  if (stream_nv) {
    C10_CUDA_CHECK(S == S_BF16 ? launch_nv1d<S_BF16>(k, st) : launch_nv1d<S_F16>(k, st));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return p.outs;
  }
  const int64_t grid = grid_of(k);
  switch (S) {
    case S_F32: launch_for_dst<S_F32>(D, k, grid, st); break;
    case S_BF16: launch_for_dst<S_BF16>(D, k, grid, st); break;
    case S_F16: launch_for_dst<S_F16>(D, k, grid, st); break;
    case S_FP8: launch_for_dst<S_FP8>(D, k, grid, st); break;
    case S_MX: launch_for_dst<S_MX>(D, k, grid, st); break;
    case S_NV: launch_for_dst<S_NV>(D, k, grid, st); break;
    case S_MX4: launch_for_dst<S_MX4>(D, k, grid, st); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return p.outs;
}

at::Tensor amax_cuda(at::TensorList src, c10::string_view src_format, at::IntArrayRef src_block) {
  Plan p;
  plan_source(p, src, src_format, src_block);
  TORCH_INTERNAL_ASSERT(p.device.is_cuda());
  TORCH_CHECK(p.M > 0 && p.K > 0, "ckptq: cannot take the per-tensor amax of an empty (", p.M, ", ", p.K, ") matrix");
  c10::cuda::CUDAGuard guard(p.device);
  cudaStream_t st = c10::cuda::getCurrentCUDAStream(p.device.index());
  at::Tensor out = at::zeros(p.batch, p.s_data.options().dtype(at::kFloat));
  if (p.B == 0) return out;
  Params k{};
  fill_source(k, p);
  k.vec = p.K % 16 == 0 && aligned(k.s_data, 16);
  fill_tiling(k, p.M, p.K, 1, src_kind(p.sf), -1);
  launch_amax_kernel(k, reinterpret_cast<uint32_t*>(out.data_ptr()), st, src_kind(p.sf));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ckptq, CUDA, m) {
  m.impl("requantize", &requantize_cuda);
  m.impl("amax", &amax_cuda);
}

}  // namespace ckptq

extern "C" PyObject* PyInit__C_cuda(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C_cuda", "ckptq CUDA kernels (torch.ops.ckptq)", -1, nullptr};
  return PyModule_Create(&def);
}
