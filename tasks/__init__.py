"""Prefect tasks and the pure functions they call."""
