// Explicit instantiations of the requantize kernels for the nvfp4 target (and its pre-issue-11
// encode, kept as a switchable benchmark baseline).
#include "kernels.cuh"
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_NV)
CKPTQ_INSTANTIATE_DST(ckptq::cudak::D_NVB)  // baseline encode (CKPTQ_NVFP4_ENCODE=baseline)
// The streaming bf16 / fp16 -> nvfp4 1x16 kernel.
template cudaError_t ckptq::cudak::launch_nv1d<ckptq::cudak::S_BF16>(const ckptq::cudak::Params&, cudaStream_t);
template cudaError_t ckptq::cudak::launch_nv1d<ckptq::cudak::S_F16>(const ckptq::cudak::Params&, cudaStream_t);
