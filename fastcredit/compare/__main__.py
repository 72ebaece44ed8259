"""``python -m fastcredit.compare``: the methods comparison.

The usage is in ``fastcredit.compare.runs``'s docstring (what ``--help`` prints).
"""
import sys

from fastcredit.compare.runs import main

if __name__ == "__main__":
    sys.exit(main())
