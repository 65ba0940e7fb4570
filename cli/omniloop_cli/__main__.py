"""``python -m omniloop_cli``: the same as the ``omniloop`` console script."""

from . import main

if __name__ == "__main__":
    main()
