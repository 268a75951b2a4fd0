"""``python -m dptorch.cli``: the ``dptorch`` command."""

import sys

from dptorch.cli.commands import main

sys.exit(main())
