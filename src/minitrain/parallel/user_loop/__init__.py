"""What only a user's own training loop needs of a strategy (minitrain.prepare): the p.grad a loop ported from DDP
reads (visible_grads.py), freed parameters refused (freed_params.py), parameters used outside their module
(param_use.py), and replicas that start alike and stay alike (replica_state.py). The CLI's trainer uses none."""
