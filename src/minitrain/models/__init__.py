"""Models minitrain ships, each with its parallelism plan beside it: MiniGPT."""
