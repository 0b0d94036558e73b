// ckptq::crc32c on CUDA tensors: the crc32c of a tensor's bytes, computed where the tensor is.
//
// The arithmetic and the split of the byte range into independently hashed pieces are in
// ../crc32c.h (shared with the CPU implementation, crc32c_cpu.cpp, which tests them). Here each
// segment is one thread's; thread 0 of block 0 also hashes the unaligned head and tail. Each block
// XORs its threads' parts and XORs the result into the output, which starts as
// crc32c::start_value (atomicXor: XOR is associative and commutative, so the order in which the
// blocks finish does not change the value).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../crc32c.h"

namespace ckptq {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) crc32c_kernel(crc::Split a, unsigned long long* out) {
  __shared__ crc::Tables T;
  __shared__ uint32_t warp_acc[kThreads / 32];
  const int t = threadIdx.x;
  crc::fill_first(T, t, kThreads);
  __syncthreads();
  crc::fill_rest(T, t, kThreads);
  __syncthreads();

  uint32_t acc = 0;
  const uint64_t s = static_cast<uint64_t>(blockIdx.x) * kThreads + t;
  if (s < a.nseg) acc = crc::segment_part(T, a, s);
  if (s == 0) acc ^= crc::edges_part(T, a);
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((t & 31) == 0) warp_acc[t >> 5] = acc;
  __syncthreads();
  if (t == 0) {
    uint32_t r = 0;
    for (int w = 0; w < kThreads / 32; ++w) r ^= warp_acc[w];
    if (r != 0) atomicXor(out, static_cast<unsigned long long>(r));
  }
}

at::Tensor crc32c_cuda(const at::Tensor& data, int64_t value, int64_t segment) {
  TORCH_CHECK(data.is_cuda(), "ckptq::crc32c (CUDA): expected a CUDA tensor, got one on ", data.device());
  TORCH_CHECK(value >= 0 && value <= 0xFFFFFFFFLL, "ckptq::crc32c: value must be an unsigned 32-bit int, got ",
              value);
  TORCH_CHECK(segment >= 0, "ckptq::crc32c: segment must be >= 0 (0: automatic), got ", segment);
  c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor t = data.contiguous();
  const uint64_t n = static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
  int sm_count = 1;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, t.device().index()));
  // about 1024 threads per SM
  const crc::Split a = crc::make_split(static_cast<const uint8_t*>(t.data_ptr()), n, static_cast<uint64_t>(segment),
                                       static_cast<uint64_t>(std::max(sm_count, 1)) * 1024);
  at::Tensor out =
      at::full({}, static_cast<int64_t>(crc::start_value(a, static_cast<uint32_t>(value))), t.options().dtype(at::kLong));
  if (n == 0) return out;  // the start value is `value`
  const uint64_t blocks = std::max<uint64_t>(1, (a.nseg + kThreads - 1) / kThreads);
  TORCH_CHECK(blocks < (uint64_t(1) << 31), "ckptq::crc32c: ", n, " bytes in segments of ", a.seg,
              " need too many blocks; pass a larger segment");
  cudaStream_t st = c10::cuda::getCurrentCUDAStream(t.device().index());
  crc32c_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(
      a, reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ckptq, CUDA, m) { m.impl("crc32c", &crc32c_cuda); }

}  // namespace ckptq
