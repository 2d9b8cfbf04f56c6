"""Synthetic data sets for training and evaluating the tiny checkpoint."""
