"""Prefect flows: research and its stages."""
