// Explicit instantiations of the requantize kernels for the mxfp8 target (without and with
// the columnwise copy).
#include "kernels.cuh"
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_MX)
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_MXCW)
