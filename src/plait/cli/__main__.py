"""`python -m plait.cli COMMAND ...`: the plait command line."""

from plait.cli.main import exit_process, main

exit_process(main())
