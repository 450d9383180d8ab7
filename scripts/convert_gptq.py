#!/usr/bin/env python
"""Same as the ``marlin-convert`` console script: python scripts/convert_gptq.py SRC DST [options]."""

import sys

from marlin.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
