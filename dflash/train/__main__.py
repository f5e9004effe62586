"""``python -m dflash.train`` (under torchrun): see :mod:`dflash.train.job`."""

from dflash.train.job import main

main()
