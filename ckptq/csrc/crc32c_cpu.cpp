// ckptq::crc32c on CPU tensors: the same split and arithmetic as the CUDA kernel (crc32c.h), each
// segment one iteration of an at::parallel_for. It exists so that the kernel's code is tested on
// machines without a GPU (tests/test_checksums.py compares it with the `crc32c` package);
// ckptq.checksums hashes CPU tensors with that package (SSE4.2 / ARMv8 CRC instructions, faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "crc32c.h"

namespace ckptq {
namespace {

at::Tensor crc32c_cpu(const at::Tensor& data, int64_t value, int64_t segment) {
  TORCH_CHECK(data.device().is_cpu(), "ckptq::crc32c (CPU): expected a CPU tensor, got one on ", data.device());
  TORCH_CHECK(value >= 0 && value <= 0xFFFFFFFFLL, "ckptq::crc32c: value must be an unsigned 32-bit int, got ",
              value);
  TORCH_CHECK(segment >= 0, "ckptq::crc32c: segment must be >= 0 (0: automatic), got ", segment);
  const at::Tensor t = data.contiguous();
  const uint64_t n = static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
  const uint8_t* p = n ? static_cast<const uint8_t*>(t.data_ptr()) : nullptr;
  const crc::Split a = crc::make_split(p, n, static_cast<uint64_t>(segment),
                                       static_cast<uint64_t>(at::get_num_threads()));
  uint32_t r = crc::start_value(a, static_cast<uint32_t>(value));
  if (n != 0) {
    static crc::Tables T;
    static const bool filled = [] {
      crc::fill_first(T, 0, 1);
      crc::fill_rest(T, 0, 1);
      return true;
    }();
    (void)filled;
    std::vector<uint32_t> parts(static_cast<size_t>(a.nseg), 0u);
    at::parallel_for(0, static_cast<int64_t>(a.nseg), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t s = lo; s < hi; ++s) parts[static_cast<size_t>(s)] = crc::segment_part(T, a, static_cast<uint64_t>(s));
    });
    for (uint32_t x : parts) r ^= x;
    r ^= crc::edges_part(T, a);
  }
  return at::full({}, static_cast<int64_t>(r), t.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_IMPL(ckptq, CPU, m) { m.impl("crc32c", &crc32c_cpu); }

}  // namespace ckptq
