"""``python -m ckptq.cli``: the same as the ``ckptq`` console script."""

from . import main

main()
