"""``python -m dptorch``: the ``dptorch`` command (:mod:`dptorch.cli`)."""

import sys

from dptorch.cli import main

sys.exit(main())
