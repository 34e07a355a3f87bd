"""Runtime: where a run happens: its workspace (home, stores, sites, catalog), the Dask
clients per site, progress sinks, and the reaper that ends a dead command's children.
"""
