"""``python -m fastcredit.compare``: the methods comparison (``fastcredit.compare.runs``, its docstring has the usage)."""
import sys

from fastcredit.compare.runs import main

if __name__ == "__main__":
    sys.exit(main())
