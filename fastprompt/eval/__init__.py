"""Evaluation: the STS protocol, geometry metrics, retrieval, plots. Only reads a model."""
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
    senteval_tokenize,
    spearman_x100,
)

__all__ = [
    "PREPROCESS", "SICK_SPLITS", "STS_TASKS", "STS_YEAR_SUBSETS", "STSB_SPLITS", "STSData",
    "cosine_similarity_pairs", "encode_pairs", "evaluate_sts", "format_sts_table", "load_sickr",
    "load_sts_task", "load_sts_tasks", "load_sts_year", "load_stsb", "parse_tasks", "score_sts",
    "senteval_tokenize", "spearman_x100",
]
