"""pytest set-up for the gmoe package tests: import gmoe as installed (`pip install .`), or from an
in-place build (python/gmoe/_ops.so, scripts/test_python.sh --inplace)."""
import os
import sys

try:
    import gmoe  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    import gmoe  # noqa: F401
