"""`python -m services.cli ...`: the `stagemesh` command."""

import sys

from services.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
