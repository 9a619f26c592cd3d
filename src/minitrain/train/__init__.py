"""Training MiniGPT with the CLI: one step (trainer), the run around it (loop), the optimizer, precision, metrics, tracking, memory and the estimator (`minitrain plan`)."""
