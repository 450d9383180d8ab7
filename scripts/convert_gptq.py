#!/usr/bin/env python
"""Same as the ``marlin-convert`` console script: python scripts/convert_gptq.py SRC DST [options]."""

import sys
from pathlib import Path

try:
    from marlin.convert.cli import main
except ModuleNotFoundError as err:
    if err.name != "marlin":
        raise
    # Run from a checkout that was built in place but not installed: the package is the
    # directory next to scripts/.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from marlin.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
