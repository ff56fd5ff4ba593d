"""``python -m qaic_dynamo <command>``: the ``qaic-dynamo`` command line (``qaic_dynamo.cli``)."""

import sys

from qaic_dynamo.cli import main

if __name__ == "__main__":
    sys.exit(main())
