"""Models built in code (the ``tiny`` policy for CPUs, tests and the embedded default)."""
