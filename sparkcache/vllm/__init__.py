"""SparkCache's vLLM integration (imports vLLM; not imported by the rest of SparkCache)."""
