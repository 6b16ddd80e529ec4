"""``python -m dmi.cli``: the ``dmi`` command."""
import sys

from . import main

sys.exit(main())
