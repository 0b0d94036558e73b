"""The ckptq version (what ``ckptq --version`` prints and exported folders record)."""

__version__ = "0.1.0"
