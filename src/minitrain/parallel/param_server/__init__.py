"""Parameter servers: workers push gradients and pull parameters; servers hold the optimizer (protocol.py says
what each message is; worker.py is the strategy a worker trains with; server.py applies the updates)."""
from .server import ParameterServer
from .worker import ParameterServerWorker

__all__ = ["ParameterServer", "ParameterServerWorker"]
