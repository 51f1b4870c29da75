import sys

from e3.cli.main import main

sys.exit(main())
