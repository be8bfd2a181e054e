"""`python -m plait COMMAND ...` (and `torchrun ... -m plait train ...`): the plait command line."""

from plait.cli.main import exit_process, main

exit_process(main())
