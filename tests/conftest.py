"""Settings every test module shares.

Hypothesis's per-example deadline (200 ms by default) is a timed assertion: on a loaded 2-core machine a planner
example that takes 6 ms alone took 1.5 s beside vLLM engines and failed. Examples are bounded by what they do, and
a hung one by pytest-timeout, so the deadline is off for the whole suite.
"""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("kvsvc", deadline=None)
settings.load_profile("kvsvc")
