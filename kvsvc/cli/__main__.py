from __future__ import annotations

import sys

from kvsvc.cli import main

sys.exit(main())
