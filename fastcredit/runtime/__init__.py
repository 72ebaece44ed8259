"""What every command runs on: metrics tracking, profiling (NVTX, phase timers), batching for asyncio callers, and
files (atomic writes, built-from stamps of generated folders, seeding)."""
