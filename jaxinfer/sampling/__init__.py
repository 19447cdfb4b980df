"""Sampling: per-request parameters (host) and the jitted sampler (device)."""
