"""`python -m tierd` is the `tierd` command."""

import sys

from .cli import main

sys.exit(main())
