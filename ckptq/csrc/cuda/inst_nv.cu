// Explicit instantiations of the requantize kernels for the nvfp4 target.
#include "kernels.cuh"
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_NV)
