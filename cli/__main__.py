"""`python -m cli ...`: the `cellserve` command without the console script."""

import sys

from cli.main import main

sys.exit(main())
