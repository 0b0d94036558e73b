// Explicit instantiations of the requantize kernels for the mxfp4 target (1x32 E8M0 blocks).
#include "kernels.cuh"
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_MX4)
