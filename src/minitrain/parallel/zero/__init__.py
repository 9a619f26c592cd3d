"""ZeRO (Rajbhandari et al.): stage 1 shards the optimizer state (zero1.py), 2 also the gradients (zero2.py,
gradient_shard.py), 3 also the parameters (sharded_units.py, whose reshard_after_forward=False is the trainer's
ZeRO-2); sharded.py is what they share."""
