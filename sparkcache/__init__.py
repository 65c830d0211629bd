"""SparkCache: a KV-cache page store beside vLLM."""

__version__ = "0.1.0"
