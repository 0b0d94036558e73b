"""Test stand-in for NVIDIA TransformerEngine -- NOT TransformerEngine.

Reproduces only what ckptq's TE adapter and its tests need: TE's module paths, class names, the
pickle reconstructors and their positional payloads, quantizer ``__dict__`` key orders, storage
attribute names and buffer layouts (facts: docs/producers.md, "2. TransformerEngine"; TE ``main`` at
d0067d0). Written for ckptq's tests; no TE code is copied. It lives under ``tests/``
and is importable only when a test puts ``tests/te_standin`` on ``sys.path`` (``tests/_te.py``).
"""

__version__ = "2.99.0+standin"
