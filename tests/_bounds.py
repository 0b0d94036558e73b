"""Every SQNR bound the test suite uses, in one place, each with its reason.

Lossless paths are tested bit-exact; these bounds are for the lossy ones (quantize, requantize,
re-encode). They are floors for dequantize(quantize(x)) and for re-encodings of quantized values,
on Gaussian inputs; a test that needs a bound imports it from here.
"""

# Model for a float format with p explicit mantissa bits, round to nearest, no overflow or underflow:
# for x in [2^e, 2^(e+1)) the error is uniform over one ulp 2^(e-p), variance 4^(e-p) / 12, so
#   SQNR = 10 log10(E[x^2] / E[4^(e-p) / 12]) = 6.02 p + 10 log10(12 E[x^2] / E[4^floor(log2|x|)]).
# The last term depends only on the shape of the distribution: 14.5 dB for a mantissa uniform in a
# binade; for a Gaussian (measured on 4M samples: 13.44 dB; it is computed on the test input below)
# the energy-carrying values sit low in their binades. Hence E4M3 (p = 3): 31.5 dB, E5M2 (p = 2): 25.5 dB.
# Per-tensor, blockwise, pow2 and E8M0 scaling do not change this: scaling by any factor keeps the
# relative error of normal values, and a Gaussian's values below amax * 2^-15 (where E4M3 turns
# subnormal) carry < 1e-9 of its energy. Dequantizing to bf16/fp16 adds a rounding with 8/11
# significant bits (>= 50 dB), negligible.
# NVFP4 (E2M1, one mantissa bit but only three binades plus 0.5): the model is an ideal E2M1 RNE
# quantizer with the exact block scale amax_b / 6 (computed below): 20.5 dB for 1x16 blocks, 19.1 dB
# for 16x16 (one amax over 256 values leaves more values in the coarse region below 1).
# E4M3 rounding of the block scale (relative error <= 2^-4) and the clamp at 6 cost ~0.15 dB more.
# Floors: model - 1.5 dB (a quarter of a bit). The SQNR estimate on 131k samples moves < 0.1 dB
# with the seed, so the margin is all for effects the model leaves out; a bug costing one bit --
# truncation instead of RNE (error uniform over a whole ulp: 4x the variance), a lost mantissa bit,
# a block scale off by 2x for NVFP4 -- costs ~6 dB and fails. An upper bound (model + 1 dB) catches
# a "dequantize" that returns something closer to the input than the format can hold.
FLOOR_E4M3 = 30.0  # model 31.5 dB
FLOOR_E5M2 = 24.0  # model 25.5 dB
FLOOR_NVFP4_1D = 19.0  # model 20.5 dB
FLOOR_NVFP4_2D = 17.5  # model 19.1 dB

# Re-encoding values that are already quantized (requantize into another format or block grid):
# the second rounding costs at most the target format's own error, and the source's error adds
# (uncorrelated) on top; floors = the target's model floor minus a few dB for that sum.
#: MXFP8 re-encoded on other block boundaries (every value re-rounded to E4M3 under a new pow2 scale).
REENCODE_E4M3 = 25.0
#: NVFP4 (E2M1 with 1x16 or 16x16 E4M3 scales) from FP8/MXFP8/NVFP4 values: ~19-20 dB model.
REENCODE_NVFP4 = 15.0
