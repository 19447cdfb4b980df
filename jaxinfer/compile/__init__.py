"""Compilation of the engine's step shapes: buckets, warm-up, the job plan, progress."""
