"""``python -m ckptq``: the same as the ``ckptq`` console script."""

from .cli import main

main()
