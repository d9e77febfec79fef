"""offline-agent: reinforcement learning on the logs of LLM agents."""
__version__ = "0.1.0"
