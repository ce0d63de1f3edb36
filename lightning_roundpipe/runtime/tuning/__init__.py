"""Profiling, the automatic choice of partition and rounds, plan state in checkpoints, max-seq."""
