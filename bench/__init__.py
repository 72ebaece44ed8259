"""The benchmarks, run from the repository root: as modules (``python -m bench.bench_step ...``), or through
pytest-benchmark (``make bench``: ``pytest --benchmark-only bench``; the CPU cases everywhere, the kernel cases
where CUDA is). Results go to ``bench/results/``, named after the device."""
