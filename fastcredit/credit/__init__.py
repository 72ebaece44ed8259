"""Credit assignment: outcome rewards in, per-turn / per-token advantages out (pure tensor functions)."""
