"""The GPU check (``make gpu-check``: ``gpu_check.sh`` and its stages), the checks of the GPU path a CPU can run
(``make gpu-preflight``), and the logistics of a lent GPU machine without network (``gpu_lease.sh``, the vLLM kit).
Stdlib-only at import: ``gpu_preflight_build`` runs under any Python >= 3.11, and ``gpu_check``'s env stage before
anything is installed."""
