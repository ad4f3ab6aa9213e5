"""python -m nemoflow == the nemoflow command."""

import sys

from nemoflow.cli import main

sys.exit(main())
