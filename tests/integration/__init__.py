"""Integration tests against real engines (opt-in by marker: ``pytest -m vllm``); see docs/vllm-cpu.md."""
