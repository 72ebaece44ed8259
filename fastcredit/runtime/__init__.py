"""What every command runs on: metrics tracking, profiling (NVTX, phase timers), batching for asyncio callers."""
