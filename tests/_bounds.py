"""Every SQNR bound the test suite uses, in one place.

Lossless paths are tested bit-exact; these bounds are for the lossy ones (quantize, requantize,
re-encode). They are floors for dequantize(quantize(x)) and for re-encodings of quantized values,
on Gaussian inputs; a test that needs a bound imports it from here. The values and their reasons
live in the library (:data:`ckptq.metrics.SQNR_FLOORS`, :data:`ckptq.metrics.REENCODE_FLOORS`),
where ``ckptq verify A B`` judges pairs of different encodings by them. The tests also check an
upper bound (model + 1 dB), which catches a "dequantize" that returns something closer to the input
than the format can hold.
"""

from ckptq.metrics import REENCODE_FLOORS, SQNR_FLOORS

FLOOR_E4M3 = SQNR_FLOORS["e4m3"][0]  # model 31.5 dB
FLOOR_E5M2 = SQNR_FLOORS["e5m2"][0]  # model 25.5 dB
FLOOR_NVFP4_1D = SQNR_FLOORS["nvfp4"][0]  # model 20.5 dB
FLOOR_NVFP4_2D = SQNR_FLOORS["nvfp4_2d"][0]  # model 19.1 dB
FLOOR_MXFP4 = SQNR_FLOORS["mxfp4"][0]  # model 18.7 (rceil) to 19.0 (even) dB
FLOOR_MXFP4_CEIL = SQNR_FLOORS["mxfp4_ceil"][0]  # model 16.8 dB

#: MXFP8 re-encoded on other block boundaries (every value re-rounded to E4M3 under a new pow2 scale).
REENCODE_E4M3 = REENCODE_FLOORS["e4m3"][0]
#: NVFP4 (E2M1 with 1x16 or 16x16 E4M3 scales) from FP8/MXFP8/NVFP4 values: ~19-20 dB model.
REENCODE_NVFP4 = REENCODE_FLOORS["nvfp4"][0]
#: MXFP4 (E2M1 with 1x32 E8M0 scales) from or to any other encoding: ~16.5-19 dB model.
REENCODE_MXFP4 = REENCODE_FLOORS["mxfp4"][0]
