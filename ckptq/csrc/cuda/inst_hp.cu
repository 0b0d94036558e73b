// Explicit instantiations of the requantize kernels for the high-precision targets (split across
// files so that the build compiles them in parallel).
#include "kernels.cuh"
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_F32)
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_BF16)
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_F16)
