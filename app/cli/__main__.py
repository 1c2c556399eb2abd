"""`python -m app.cli ...` is the `wavefarm` command (what the demo and the tests start)."""

import sys

from app.cli import main

sys.exit(main())
