"""Where the tests find the repository: its root, `configs/` and the test fixtures."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
