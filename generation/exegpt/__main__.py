"""``python -m e3.generation.exegpt``: see :mod:`e3.generation.exegpt.cli`."""

import sys

from e3.generation.exegpt.cli import main

sys.exit(main())
