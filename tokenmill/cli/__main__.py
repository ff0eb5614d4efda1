"""`python -m tokenmill.cli ...`, the same as the `tokenmill` command."""

import sys

from tokenmill.cli import main

sys.exit(main())
