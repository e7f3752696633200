"""Offline evaluation: benchmark data, per-task scoring, metrics and reports."""
