"""Models and their forwards: the ``tiny`` policy built in code (CPUs, tests, the embedded default), packed
attention (``varlen``), the policy and value model wrappers over packed trajectories (``packed``), the PRM."""
