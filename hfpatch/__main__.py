"""``python -m hfpatch``: the command line, ``hfpatch.cli.main``."""
import sys

from hfpatch.cli import main

sys.exit(main())
