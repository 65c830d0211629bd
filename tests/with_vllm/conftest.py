"""The vLLM tests run in the environments scripts/setup-vllm builds (scripts/test runs
them there); where vLLM cannot be imported they are not collected."""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py", "harness.py"]
