"""``python -m workloads.train``: see the package's docstring."""

import sys

from workloads.train.run import main

if __name__ == "__main__":
    sys.exit(main())
