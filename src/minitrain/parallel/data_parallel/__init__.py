"""Data parallel: every rank holds the whole model and optimizer; the gradients are averaged with bucketed
all-reduces that overlap backward (data_parallel.py, on core/buckets.py)."""
