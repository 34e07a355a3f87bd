"""Data: LOBSTER ingest and the synthetic generator, the landed partitions' catalog and
their schema, replication to other sites.
"""
