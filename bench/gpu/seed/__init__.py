"""Helpers of the seed reproduction benchmark (bench/gpu/seed_repro.py)."""
