"""The engine: replicas of the pipeline, each one's step loop (core.py) and mesh changes, the scheduler and its requests, drafting, the prefix cache, the stages' client and the metrics."""
