"""Old entry point: `python -m engines.sglang_serve` runs `python -m engines.fleet.serve`."""

import sys

from engines.fleet.serve import main

if __name__ == "__main__":
    sys.exit(main())
