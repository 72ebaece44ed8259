"""What is not the package and not a benchmark, run from the repository root as modules (``python -m tools...``)."""
