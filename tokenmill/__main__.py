"""`python -m tokenmill ...`, the same as the `tokenmill` command (as `python -m vllm.entrypoints.cli.main`)."""

import sys

from tokenmill.cli import main

sys.exit(main())
