"""Evaluation: the STS protocol, geometry metrics, retrieval, plots. Only reads a model."""
