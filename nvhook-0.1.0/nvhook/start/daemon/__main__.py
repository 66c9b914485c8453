"""`python -m nvhook.start.daemon`: nvhookd, as bin/nvhookd runs it."""

import sys

from . import main

sys.exit(main())
