import sys

from hfpatch.cli import main

sys.exit(main())
