"""`python -m plait COMMAND ...` (and `torchrun ... -m plait train ...`): the plait command line."""

import sys

from plait.cli import main

sys.exit(main())
