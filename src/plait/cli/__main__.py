"""`python -m plait.cli COMMAND ...`: the plait command line."""

import sys

from plait.cli.main import main

sys.exit(main())
