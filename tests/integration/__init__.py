"""Integration tests against real servers and engines that the tests start on 127.0.0.1 and stop afterwards.

The real vLLM engine tests (marker ``vllm``) are opt-in: ``pytest -m vllm tests/integration``; see docs/vllm-cpu.md.
"""
