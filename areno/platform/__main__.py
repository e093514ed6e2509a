"""`python -m areno.platform COMMAND`: the installer's commands (``areno.platform.commands``)."""

import sys

from areno.platform.commands import main

sys.exit(main())
