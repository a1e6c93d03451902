"""Accuracy evals run through the offline Engine (``python -m srt.eval.gpqa``)."""
