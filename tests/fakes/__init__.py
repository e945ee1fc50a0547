"""Fakes for tests and benchmarks. Everything here is a stand-in, named as one: never a real engine."""
