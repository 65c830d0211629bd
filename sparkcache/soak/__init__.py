"""``sparkcache soak``: the near-full slowdown reproduced on one machine, lane by lane.

A small serving engine (``engine``) stands in for vLLM and reaches SparkCache only
through the connector's vLLM-free pieces (``backend``); ``inline`` models the
predecessor's shape for comparison; ``lanes`` runs one lane (a supervisor, probes, a soak,
probes), ``run`` runs every lane and ``report`` prints, writes and plots what they
measured. docs/soak.md describes what each lane and figure means.
"""
