"""``python -m jaxinfer``: the command line (``jaxinfer.cli.main``)."""

import sys

from jaxinfer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
