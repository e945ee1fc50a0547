"""A discrete-event simulator of a P/D serving cluster timed by a performance profile (see simulator.py)."""
