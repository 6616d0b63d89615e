"""Attention kernels: blocks merged by log-sum-exp, decode, the training group and dense kernels."""
