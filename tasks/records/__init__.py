"""Records: what a run leaves for an auditor: MLflow tracking and the model registry, node
manifests, summaries, provenance digests, reproduction, recipes and the run lookups
built on them.
"""
