"""The trainer: the loop (``loop.Trainer``), the parts it is built from, the update, held-out evaluation,
the warm start and the GPU / host memory plan. Import the module you need: this package imports nothing,
so ``--memory-report`` reads its plan without loading torch."""
