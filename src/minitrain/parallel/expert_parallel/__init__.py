"""Expert parallelism: each rank keeps its share of a mixture of experts' experts, and tokens travel to their
experts' ranks and back by all-to-all (experts.py)."""
