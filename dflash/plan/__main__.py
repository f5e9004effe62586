"""``python -m dflash.plan``: see :mod:`dflash.plan.app`."""

from dflash.plan.app import main

if __name__ == "__main__":
    main()
