"""``python -m jaxinfer``: the command line (``jaxinfer.cli``)."""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
    sys.exit(main())
