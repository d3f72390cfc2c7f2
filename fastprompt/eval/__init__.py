"""Evaluation: the STS protocol, geometry metrics, retrieval, plots, a training run's report. Only reads a model
(and a run's files)."""
from .geometry import (
    alignment,
    anisotropy,
    bootstrap_spearman,
    geometry_report,
    plot_cosine_density,
    retrieval_recall,
    uniformity,
)
from .sts import (
    PREPROCESS,
    SICK_SPLITS,
    STS_TASKS,
    STS_YEAR_SUBSETS,
    STSB_SPLITS,
    STSData,
    cosine_similarity_pairs,
    encode_pairs,
    evaluate_sts,
    format_sts_table,
    load_sickr,
    load_sts_task,
    load_sts_tasks,
    load_sts_year,
    load_stsb,
    parse_tasks,
    score_sts,
    scores_from_pairs,
    sentence_vectors,
    senteval_tokenize,
    spearman_x100,
)

__all__ = [
    "PREPROCESS", "SICK_SPLITS", "STS_TASKS", "STS_YEAR_SUBSETS", "STSB_SPLITS", "STSData",
    "cosine_similarity_pairs", "encode_pairs", "evaluate_sts", "format_sts_table", "load_sickr",
    "load_sts_task", "load_sts_tasks", "load_sts_year", "load_stsb", "parse_tasks", "score_sts",
    "scores_from_pairs", "sentence_vectors", "senteval_tokenize", "spearman_x100",
    "alignment", "anisotropy", "bootstrap_spearman", "geometry_report", "plot_cosine_density",
    "retrieval_recall", "uniformity",
]
