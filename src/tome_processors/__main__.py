"""`python -m tome_processors bench ...`: the same as the `tome-processors` console script."""

import sys

from .cli.main import main

sys.exit(main())
