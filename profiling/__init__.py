"""The GPU optimization ladder: rungs, timing, equivalence."""
