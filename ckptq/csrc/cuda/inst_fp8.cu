// Explicit instantiations of the requantize kernels for the fp8_tensor and fp8_block targets.
#include "kernels.cuh"
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_FP8T)
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_FP8B)
