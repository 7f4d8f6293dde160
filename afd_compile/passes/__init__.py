"""Pure graph passes and analyses (no process groups). One job per file."""
