"""``python -m dynmb.cli VERB ...``: the ``dynmb`` command."""

import sys

from dynmb.cli.main import main

sys.exit(main())
