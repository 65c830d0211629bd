"""The vLLM tests run in the environments scripts/setup-vllm builds; anywhere else they
are skipped (scripts/test runs them there)."""

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run through scripts/test (scripts/setup-vllm)")
