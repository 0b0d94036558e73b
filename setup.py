"""Build of the optional C++ (and, where CUDA torch + nvcc exist, CUDA) kernels.

Set ``CKPTQ_NO_EXT=1`` to skip every extension (the pure-PyTorch reference backend always works).
"""

from setuptools import setup

setup()
